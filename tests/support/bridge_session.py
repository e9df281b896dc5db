"""What a red/green session got of megatron.bridge, recorded as a test's property (tests/test_red_green.py adds this
file to a session's arguments and reads the record). The runner imports megatron.bridge once, before it forks; a
session keeps that import only where each of its modules is the same file in the session's own tree. Not a test_
file: the suite's own session does not collect it."""

import json


def test_record_megatron_bridge(record_property):
    # This form reads the attribute `megatron.bridge` first, which a dropped import may leave behind.
    from megatron import bridge

    found = {"file": bridge.__file__, "path": list(bridge.__path__), "marked": hasattr(bridge, "MTP_FIX_MARK")}
    record_property("reason", json.dumps(found))  # the session's record carries it (Run.reasons)
