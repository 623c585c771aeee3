"""A deliberately broken user reward for the trainer tests: raises on some responses."""


def score(prompt: str, response: str, ground_truth: str, extra=None) -> float:
    if response.strip() in ("3", "7"):
        raise RuntimeError("this reward function is broken on purpose")
    return float(response.strip() == ground_truth.strip())
