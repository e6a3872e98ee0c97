"""prefixd.wal: the write-ahead log of a prefixd state directory, on LMDB.

This docstring is the format specification. The cache (``prefixd.cache``) decides what records
mean and what checkpoints contain; this package decides how they are stored, made durable and
read back. It imports only lmdb, msgpack, numpy, xxhash, google-crc32c, the stdlib and
``prefixd.crashpoints``.

Files
-----
``<state_dir>/lock``
    ``flock(LOCK_EX | LOCK_NB)`` for the daemon's lifetime; contains the holder's pid. A second
    daemon on the directory is refused naming that pid (``StateLockedError``).
``<state_dir>/wal/data.mdb``, ``lock.mdb``
    One LMDB environment (``max_dbs`` = 8, ``lock=True``) with four named databases:

    ``log``
        key: lsn as u64 big-endian (8 bytes), so cursor order is lsn order and groups are
        written with ``MDB_APPEND``; value: one record.
    ``index``, ``seqs``
        the checkpoint (below).
    ``meta``
        ``format_version`` (u64 BE), ``kinds`` (msgpack table of record kinds), ``root_seed``
        (16 random bytes, created once), ``layouts`` (the caller's bytes), ``checkpoint_lsn``
        (u64 BE), ``epoch`` (u64 BE, +1 at every open), ``boot_id`` (kernel boot id at the
        last open).

Records
-------
A record is ``kind u8 | fixed fields | blob | crc32c u32``. Fixed fields are the kind's struct
layout, little-endian, unpadded (``Q`` u64, ``I`` u32, ``B`` u8, ``d`` f64). The blob is optional
trailing bytes whose layout the cache defines; its length is implied by the value length. The
crc32c (Castagnoli, little-endian) covers every byte before it: kind, fields and blob.

=====  ===========  ====================================================  ====
code   kind         fixed fields, in order                                blob
=====  ===========  ====================================================  ====
1      ATTACH       session_id Q, epoch I                                 yes (client name, utf-8)
2      DETACH       session_id Q                                          no
3      OPEN         seq_id Q, session_id Q, num_tokens I, num_cached_blocks I   yes
4      EXTEND       seq_id Q, num_tokens I                                yes
5      COW          seq_id Q, old_slot I, new_slot I                      no
6      FORK         parent_seq_id Q, first_child_id Q, num_children I     no
7      COMMIT       seq_id Q, num_blocks I                                yes
8      RELEASE      seq_id Q                                              no
9      BLOCK_PUT    tier B, num_blocks I                                  yes
10     BLOCK_MOVE   tier B, num_blocks I                                  yes
11     BLOCK_DROP   tier B, num_blocks I                                  yes
12     TOUCH        time d, num_blocks I                                  yes
13     RECOVER      epoch I, host_kept B                                  no
=====  ===========  ====================================================  ====

The table lives in ``kinds.KIND_SPECS``; adding a kind is one row there.

Versioning
----------
``format_version`` covers the envelope: key encoding, record framing, checksum, checkpoint
chunking. Any change to it bumps the version, and a state directory with another version is
refused (``StateMismatchError``): there is no silent upgrade. Record kinds are versioned by the
saved ``kinds`` table: a build may add kinds (the table is extended at open), but a saved kind
that this build lacks (a downgrade) or lays out differently is refused. Saved ``layouts`` that
differ from the caller's are refused too.

Group commit and durability
---------------------------
``append`` assigns the next lsn and buffers the record; a committer thread writes the whole
pending buffer as one group in one write transaction. Records appended while a commit is in flight
go into the next group. A ``flush()`` ticket resolves when every record appended before it is
durable per ``sync``:

- ``commit``: the environment is opened with LMDB's sync on, so each commit is data fdatasync,
  meta page write, fdatasync. Survives power loss. (``sync=False`` plus an explicit
  ``env.sync(True)`` saves one fdatasync but writes the meta page unordered with the data pages,
  so a power cut between them could leave a meta page pointing at unwritten pages: not used.)
- ``interval``: the environment runs without sync; the committer fsyncs at most every
  ``interval_ms`` and tickets resolve after that fsync. A process crash loses nothing committed
  (the pages are in the kernel's cache); a power cut loses up to one interval and, on a
  filesystem that reorders writes, may damage the environment (LMDB's MDB_NOSYNC caveat).
- ``none``: commits without fsync; for benchmarks only.

A failed commit or fsync poisons the log: every waiting and later ticket fails and ``append``
raises ``WalFailedError``. An fsync is never retried into a success (the kernel may have dropped
the dirty pages it failed to write). One exception: a checkpoint whose write transaction meets a
full filesystem (ENOSPC, EDQUOT) is aborted before its meta page, the log is as it was, and it
raises ``WalNoSpaceError`` without poisoning anything: the caller retries later.

Checkpoint
----------
A checkpoint is the caller's state as of lsn L, given as two maps of byte strings (``index``,
``seqs``). Writing one, in ONE write transaction: replaces the contents of ``index`` and ``seqs``
wholly, sets ``meta.checkpoint_lsn = L``, deletes every ``log`` record with lsn <= L. A crash
therefore leaves either the old checkpoint with its log or the new one with the shorter log.
Stored per user key K: ``K || u32 BE chunk number -> xxh3-64(chunk) u64 LE || chunk``, chunks of
at most 1 MiB (LMDB needs contiguous pages for one big value; chunks reuse freed pages). The
checkpoint is a job for the committer thread: it runs after the group holding every record
appended before it was submitted, and before any later group, so it serializes with group commit
while appends continue.

Replay
------
``replay(after_lsn)`` yields every committed record with lsn > max(after_lsn, checkpoint lsn) in
lsn order, each verified (checksum, length, kind), and checks the lsns are contiguous. Because
LMDB commits are atomic, a crash loses whole groups and never leaves a torn record: there is no
torn-tail rule, and any bad record or gap raises ``WalCorruptError(lsn, reason)``.
``replay_batches(after_lsn)`` gives the same records, equally verified, as batches of raw values
(``(lsn of the first, [value, ...])``) for a caller that decodes fields itself; ``prefetch``
starts a thread that pulls the log's pages into the page cache meanwhile (a hint: bounded,
stopped by ``Prefetch.stop()`` or ``close``, never a check of the log). After a restart
the lsn counter continues at max(last log lsn, checkpoint lsn) + 1.

Process rules
-------------
One environment per process per state directory (``EnvAlreadyOpenError``); never used across
``fork()`` (``ForkedEnvError``); the map doubles on ``MapFullError`` and the transaction is rerun;
stale LMDB reader slots are cleared at open and every 4096 groups or 60 s.
"""

from prefixd.wal.codec import Record, decode, encode
from prefixd.wal.errors import (
    EnvAlreadyOpenError,
    ForkedEnvError,
    StateLockedError,
    StateMismatchError,
    WalClosedError,
    WalCorruptError,
    WalError,
    WalFailedError,
    WalNoSpaceError,
)
from prefixd.wal.group import WalStats
from prefixd.wal.meta import FORMAT_VERSION, MetaInfo
from prefixd.wal.kinds import KIND_SPECS, Kind, field_names
from prefixd.wal.wal import Wal

__all__ = [
    "FORMAT_VERSION", "KIND_SPECS", "EnvAlreadyOpenError", "ForkedEnvError", "Kind", "MetaInfo",
    "Record", "StateLockedError", "StateMismatchError", "Wal", "WalClosedError", "WalCorruptError",
    "WalError", "WalFailedError", "WalNoSpaceError", "WalStats", "decode", "encode", "field_names",
]
