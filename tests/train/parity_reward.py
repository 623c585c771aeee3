"""A user reward for the dynamic-sampling test: 0 or 1 from a hash of the response text, so that groups of a
barely trained model come out mixed (about 7 in 8 groups of 4 distinct responses) whatever it has learned."""

import zlib


def score(prompt: str, response: str, ground_truth: str, extra=None) -> float:
    return float(zlib.crc32(response.encode()) % 2)
