# One image for every DSec service; the command picks the service (python -m dsec_<name>).
FROM python:3.11-slim
ENV UV_PYTHON_PREFERENCE=only-system PYTHONUNBUFFERED=1
RUN pip install --no-cache-dir uv==0.13.8
WORKDIR /app
COPY pyproject.toml uv.lock ./
COPY libs libs
COPY services services
RUN uv sync --frozen --no-dev --all-packages
ENV PATH=/app/.venv/bin:$PATH
CMD ["python", "-m", "dsec_scheduler"]
