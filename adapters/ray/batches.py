"""The text column of a Ray Data batch in, a vector column out, for every batch format Ray hands a UDF.

Ray gives `map_batches` functions a dict of numpy arrays (`batch_format="numpy"`, the
default), a pandas DataFrame (`"pandas"`) or a pyarrow Table (`"pyarrow"`); the vectors go
back in the same format, as a tensor column of shape [rows, dimensions] in every case, so
the dataset's schema does not depend on the batch format.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Batch = Any  # dict[str, np.ndarray] | pandas.DataFrame | pyarrow.Table


class BatchError(ValueError):
    """A batch Fern cannot embed; the message names the column and, where one is at fault, the row.

    `row` is the row's position in the batch Ray handed over (None for the whole column).
    """

    def __init__(self, message: str, column: str, row: int | None = None) -> None:
        super().__init__(message)
        self.column = column
        self.row = row


def _columns(batch: Batch) -> list[str]:
    if isinstance(batch, dict):
        return list(batch)
    if hasattr(batch, "iloc"):  # pandas
        return [str(name) for name in batch.columns]
    return list(batch.column_names)  # pyarrow


def _values(batch: Batch, column: str) -> list:
    """The column's values as a Python list, whatever the batch format."""
    if isinstance(batch, dict):
        return list(batch[column])
    if hasattr(batch, "iloc"):  # pandas
        return batch[column].tolist()
    return batch.column(column).to_pylist()  # pyarrow


def _described(value: object) -> str:
    """'a missing value (None)' for None, NaN and pandas' NA (each format's null), else type and repr."""
    nan = isinstance(value, (float, np.floating)) and bool(np.isnan(value))
    if value is None or nan or type(value).__name__ == "NAType":
        return f"a missing value ({value!r})"
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return f"{type(value).__name__} {shown}"


def texts_of(batch: Batch, column: str) -> list[str]:
    """The strings of `column`; BatchError when the column is missing or a value is not a string."""
    if column not in _columns(batch):
        raise BatchError(f"column {column!r} is not in the batch (its columns: "
                         f"{', '.join(map(repr, _columns(batch))) or 'none'})", column)
    texts = _values(batch, column)
    for row, value in enumerate(texts):
        if not isinstance(value, str):
            raise BatchError(f"column {column!r}, row {row} of the batch: expected a string, got "
                             f"{_described(value)}", column, row)
    return texts


def with_vectors(batch: Batch, column: str, vectors: np.ndarray) -> Batch:
    """`batch` plus `column` holding `vectors` (float32 [rows, dims]), in the batch's own format."""
    if isinstance(batch, dict):
        return {**batch, column: vectors}
    if hasattr(batch, "iloc"):  # pandas: one ndarray per cell, which Ray stores as a tensor column
        out = batch.copy(deep=False)
        out[column] = list(vectors)
        return out
    from ray.data.extensions import ArrowTensorArray

    if column in batch.column_names:
        batch = batch.drop_columns([column])
    return batch.append_column(column, ArrowTensorArray.from_numpy(vectors))


def located(error: Exception, column: str, offset: int) -> BatchError | None:
    """A Fern refusal of one input (`error.index` set) as a BatchError naming the column and row.

    `offset` is the row of the request's first text in the batch; None when the error is not
    about one input (model not found, queue full), which the caller then raises as it is.
    """
    index = getattr(error, "index", None)
    if index is None:
        return None
    message = getattr(error, "message", str(error))
    # The sidecar names the input "texts[i]: ..."; the batch's row says more to the caller.
    detail = message.split(": ", 1)[1] if message.startswith("texts[") and ": " in message else message
    row = offset + index
    return BatchError(f"column {column!r}, row {row} of the batch: {detail}", column, row)


def slices(count: int, size: int) -> list[slice]:
    """[0, count) cut into consecutive slices of at most `size` rows."""
    return [slice(start, min(start + size, count)) for start in range(0, count, size)]
