"""The encoding table agrees with the wire contract and packs rows the way the decoder reads them."""

import numpy as np

from sidecar import encodings
from sidecar.gateway import ENCODINGS
from sidecar.wire import embedder_pb2 as pb


def test_every_wire_encoding_has_one_entry_named_after_it():
    assert sorted(encodings.BY_WIRE) == sorted(pb.Encoding.values())
    for encoding in encodings.BY_NAME.values():
        assert pb.Encoding.Name(encoding.wire) == f"ENCODING_{encoding.name.upper()}"
    assert ENCODINGS == encodings.NAMES == ("float32", "float16", "int8", "binary")


def test_columns_match_what_packbits_and_the_dtype_give():
    for d in (1, 7, 8, 9, 384, 1023):
        assert encodings.BINARY.columns(d) == np.packbits(np.ones(d, bool)).size
        for name in ("float32", "float16", "int8"):
            assert encodings.BY_NAME[name].columns(d) == d
    for encoding in encodings.BY_NAME.values():
        assert encoding.dtype == encoding.dtype.newbyteorder("<")


def test_the_cli_offers_the_tables_encodings():
    from sidecar.cli import ENCODING_NAMES

    assert ENCODING_NAMES == encodings.NAMES
