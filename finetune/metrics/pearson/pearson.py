"""Pearson correlation between predictions and references."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Pearson's r: covariance of predictions and references over the product of their standard deviations."
_INPUTS = """
Args:
    predictions (list of float): predicted values.
    references (list of float): true values.
Returns:
    pearson (float): in [-1, 1]; nan when either side is constant.
"""


class Pearson(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("float64"),
                                        "references": datasets.Value("float64")}),
        )

    def _compute(self, predictions, references):
        p, r = np.asarray(predictions, dtype=np.float64), np.asarray(references, dtype=np.float64)
        if p.std() == 0 or r.std() == 0:
            return {"pearson": float("nan")}
        return {"pearson": float(np.corrcoef(p, r)[0, 1])}
