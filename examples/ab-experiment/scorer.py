"""The A/B example's scorer: how close a risk score is to the analysts' label (1 is perfect)."""

LABELS = {
    "u1": 0.9, "u2": 0.05, "u3": 0.6, "u4": 0.7, "u5": 0.8, "u6": 0.2,
    "u7": 0.65, "u8": 0.0, "u9": 0.6, "u10": 0.55, "u11": 0.1, "u12": 0.9,
}  # fmt: skip


def score(input_id: str, output: float) -> float:
    return 1.0 - abs(float(output) - LABELS[input_id])
