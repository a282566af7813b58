"""bench.wal_relations sums pg_waldump's records by the relation each names and its kind."""

from __future__ import annotations

from bench.wal_relations import by_relation

DUMP = """\
rmgr: Heap        len (rec/tot):     79/    79, tx:        744, lsn: 0/01A2B3C8, prev 0/01A2B390, desc: INSERT off: 3, flags: 0x00, blkref #0: rel 1663/5/16400 blk 0
rmgr: Heap        len (rec/tot):     54/  8250, tx:        744, lsn: 0/01A2B418, prev 0/01A2B3C8, desc: UPDATE old_xmax: 744, old_off: 2, blkref #0: rel 1663/5/16400 blk 1 FPW
rmgr: Btree       len (rec/tot):     64/    64, tx:        744, lsn: 0/01A2D480, prev 0/01A2B418, desc: INSERT_LEAF off: 9, blkref #0: rel 1663/5/16410 blk 1
rmgr: Transaction len (rec/tot):     34/    34, tx:        744, lsn: 0/01A2D4C0, prev 0/01A2D480, desc: COMMIT 2026-12-06 17:00:00.000000 UTC
pg_waldump: error: error in WAL record at 0/01A2D4E8: invalid record length
"""  # noqa: E501 (pg_waldump's own lines, whole)


def test_records_are_summed_by_relation_and_kind_with_their_whole_length() -> None:
    sizes, counts = by_relation(DUMP, {"16400": "runs"})
    assert sizes == {
        "runs Heap:INSERT": 79,
        "runs Heap:UPDATE": 8250,  # its full-page image counted: the record's total length
        "16410 Btree:INSERT_LEAF": 64,  # a relation not named keeps its number
        "- Transaction:COMMIT": 34,
    }
    assert counts["runs Heap:UPDATE"] == 1 and sum(counts.values()) == 4
