"""Mean absolute error: the mean of |prediction − reference|, in the references' own units."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "MAE = mean(|predictions − references|)."
_INPUTS = """
Args:
    predictions (list of float): predicted values.
    references (list of float): true values.
Returns:
    mae (float): >= 0, in the units of the references.
"""


class Mae(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("float64"),
                                        "references": datasets.Value("float64")}),
        )

    def _compute(self, predictions, references):
        predictions, references = np.asarray(predictions, dtype=np.float64), np.asarray(references, dtype=np.float64)
        return {"mae": float(np.abs(predictions - references).mean())}
