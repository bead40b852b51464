"""Token F1 and exact match of generated answers against reference answers (SQuAD-style normalization)."""

import re
import string
from collections import Counter

import datasets
import evaluate

_DESCRIPTION = ("Token F1: the harmonic mean of precision and recall of the words an answer shares with its "
                "reference, averaged over answers; exact match: the fraction of answers equal to their reference. "
                "Both after lower-casing and removing punctuation, articles and extra whitespace.")
_INPUTS = """
Args:
    predictions (list of str): generated answers.
    references (list of str): reference answers.
Returns:
    token_f1 (float): in [0, 1].
    exact_match (float): in [0, 1].
"""


def normalize(text: str) -> list:
    """Lower-cased words without punctuation and articles."""
    text = "".join(" " if c in string.punctuation else c for c in text.lower())
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def f1(prediction: str, reference: str) -> float:
    pred, ref = normalize(prediction), normalize(reference)
    if not pred or not ref:
        return float(pred == ref)
    shared = sum((Counter(pred) & Counter(ref)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(pred), shared / len(ref)
    return 2 * precision * recall / (precision + recall)


class TokenF1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references):
        n = max(len(predictions), 1)
        return {"token_f1": sum(f1(p, r) for p, r in zip(predictions, references)) / n,
                "exact_match": sum(normalize(p) == normalize(r) for p, r in zip(predictions, references)) / n}
