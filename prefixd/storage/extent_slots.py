"""``ExtentSlotAllocator``: the free slots of a tier whose pool file is sparse
(``prefixd.storage.extents``), handed out so that extents empty out and can be given back.

It has ``SlotAllocator``'s interface and quarantine (free before reuse), and drives the file:

* ``allocate(n)`` prefers free slots in extents already held, lowest extent first, then
  never-used slots in held extents, then slots in holes (lowest first); before it hands any
  out, ``SparsePoolFile.take`` grows the extents they touch. A grow the budget or the
  filesystem refuses (``BudgetExceededError``, ``NoSpaceError``) makes ``allocate`` return
  ``None``, as a full tier does, and counts a refusal; until room may be back, ``num_free``
  counts only the free slots in held extents, so the cache's own eviction frees what it needs
  there.
* a slot becomes free for the file (``SparsePoolFile.give_back``) when it becomes allocatable:
  at ``free``, or when its quarantine batch is released (the record that freed it is durable);
  then idle extents above ``keep_idle`` are punched (``shrink``), their bytes back in the ledger.
* the first ``take`` (recovery: the slots the recovered index names) is the file's ``recover``;
  a pool that allocates first recovers with no slot in use.
"""

from __future__ import annotations

import bisect
import heapq
import numpy as np

from prefixd.storage.extents import SparsePoolFile
from prefixd.storage.grow_gate import GrowGate
from prefixd.storage.quarantine_batches import QuarantineBatches

KEEP_IDLE_EXTENTS = 1  # idle extents a pool keeps after a release: churn need not re-fallocate
_HELD, _HOLE = 1, 2


class ExtentSlotAllocator:
    """Free slots by extent, a quarantine, and the sparse file they are slots of.

    Data structure: a free slot ``s`` below ``_fresh`` sits in ``_buckets[k]`` (a stack, each
    batch pushed in descending order so that it pops as an ascending run: a copy into one run
    is one slice) for the extent ``k`` its first byte is in; ``_where[k]`` says whether that extent is held
    (``_HELD``, its bucket in the ``_held`` heap) or a hole (``_HOLE``, in ``_holes``); the
    heaps may hold stale entries, skipped when ``_where`` disagrees. Slots ``>= _fresh`` were
    never handed out. ``_quarantine`` holds the deferred slots (``QuarantineBatches``).

    Invariants (``check_invariants``): every slot is free, deferred or used exactly once;
    ``_num_ready`` counts the bucketed slots whose extent is held; every slot in use is
    counted by the file's extent map (``give_back`` only once a slot is allocatable).

    Thread safety: none; the cache core owns it (one thread).
    """

    def __init__(self, pool_file: SparsePoolFile, *, recovered: bool = False,
                 keep_idle: int = KEEP_IDLE_EXTENTS) -> None:
        """Args:
            pool_file: the pool's sparse file (its extent map says what is held).
            recovered: the file is fresh: nothing to recover before the first allocation.
            keep_idle: idle extents kept allocated after each release.
        """
        self.file = pool_file
        self.extents = pool_file.extent_map
        self.num_slots = self.extents.num_slots
        self.keep_idle = keep_idle
        self.gate = GrowGate(pool_file)  # grows of the file, and the refusals met (counted there)
        em = self.extents
        self._off, self._bb, self._ext = em.data_offset, em.block_bytes, em.extent_bytes
        self._wide = em.block_bytes > em.extent_bytes  # a slot may span several extents
        self._recovered = recovered
        self._buckets: dict[int, list[int]] = {}
        self._where: dict[int, int] = {}
        self._held: list[int] = []
        self._holes: list[int] = []
        self._num_ready = 0
        self._num_bucketed = 0
        self._fresh = 0
        self._quarantine = QuarantineBatches()
        self.may_shrink = None  # a callable: False postpones punching (writes still queued)

    # -- geometry -----------------------------------------------------------------------------

    def extent_of(self, slot: int) -> int:
        """The extent slot ``slot``'s first byte is in. Raises ValueError: out of range."""
        return self.extents.extent_of(slot)

    def extent_slots(self, extent: int) -> range:
        """The slots that touch ``extent``: freeing all of them lets ``shrink`` punch it.
        Raises ValueError: out of range."""
        return self.extents.slots_of(extent)

    # -- counts -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Free slots; while a grow is refused, only those in held extents (what can be had)."""
        if self.gate.refused():
            return self._num_ready + self._fresh_held_end() - self._fresh
        return self._num_bucketed + self.num_slots - self._fresh

    @property
    def num_deferred(self) -> int:
        return len(self._quarantine)

    @property
    def num_used(self) -> int:
        return self._fresh - self._num_bucketed - self.num_deferred

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # -- allocate -----------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free slots, their extents grown; ``None`` (nothing taken) when fewer are
        free or their extents cannot grow (a refusal, counted in ``gate.grow_refusals``)."""
        if n == 0:
            return []
        if not self._recovered:
            self.take([])
        if self._held and not self._wide:  # the common case: part of one held extent's bucket
            k = self._held[0]
            bucket = self._buckets.get(k)
            if bucket is not None and len(bucket) > n and self._where[k] == _HELD:
                out = bucket[-n:]
                straddler = self.extents.straddler(k)
                if straddler < 0 or straddler not in out:
                    del bucket[-n:]
                    out.reverse()
                    self._num_bucketed -= n
                    self._num_ready -= n
                    self.extents.add_users_of(k, n)
                    return out
        if n > self._num_bucketed + self.num_slots - self._fresh:
            return None
        out = []
        counts: dict[int, int] = {}
        taken: list[tuple[int, list[int]]] = []  # (extent, slots) popped from buckets
        if self._held:
            self._pop_from(self._held, _HELD, n, out, taken)
        fresh0 = self._fresh
        if len(out) < n:  # never-used slots in held extents
            self._take_fresh(min(n - len(out), self._fresh_held_end() - fresh0), out, counts)
        if len(out) < n and self._holes:
            self._pop_from(self._holes, _HOLE, n, out, taken)
        if len(out) < n:
            self._take_fresh(n - len(out), out, counts)
        if self._wide:
            counts = self.extents.touched(out)
        else:
            for k, slots in taken:
                self._count_chunk(k, slots, counts)
        if self._grow_for(out, counts):
            return out
        self._fresh = fresh0
        self._push([s for s in out if s < fresh0])
        return None

    def _pop_from(self, heap: list[int], where: int, n: int, out: list[int], taken: list) -> None:
        buckets, places = self._buckets, self._where
        while len(out) < n and heap:
            k = heap[0]
            if places.get(k) != where:
                heapq.heappop(heap)
                continue
            bucket = buckets[k]
            take = min(n - len(out), len(bucket))
            got = bucket[-take:]
            got.reverse()
            out += got
            taken.append((k, got))
            del bucket[-take:]
            self._num_bucketed -= take
            if where == _HELD:
                self._num_ready -= take
            if not bucket:
                heapq.heappop(heap)
                del buckets[k], places[k]

    def _take_fresh(self, m: int, out: list[int], counts: dict[int, int]) -> None:
        """The next ``m`` never-used slots, and the extents they touch counted (one run)."""
        if m <= 0:
            return
        f0 = self._fresh
        self._fresh = f1 = f0 + m
        out += range(f0, f1)
        if not self._wide:  # else counted whole by the caller
            self.extents.count_run(f0, f1, counts)

    def _fresh_held_end(self) -> int:
        """The first never-used slot that touches an extent not held (``num_slots`` if none)."""
        em = self.extents
        if self._fresh >= self.num_slots:
            return self.num_slots
        hole = em.first_hole((self._off + self._fresh * self._bb) // self._ext)
        if hole >= em.num_extents:
            return self.num_slots
        return max(self._fresh, min(self.num_slots, (hole * self._ext - self._off) // self._bb))

    def _count_chunk(self, k: int, slots: list[int], counts: dict[int, int]) -> None:
        """Count ``slots`` (all starting in extent ``k``, a slot no larger than an extent):
        ``k`` each, and ``k + 1`` for the one slot that may run over into it."""
        counts[k] = counts.get(k, 0) + len(slots)
        straddler = self.extents.straddler(k)
        if straddler >= 0 and straddler in slots:
            counts[k + 1] = counts.get(k + 1, 0) + 1

    def _grow_for(self, slots: list[int], counts: dict[int, int]) -> bool:
        if not self.gate.grow(slots, counts):
            return False
        places = self._where
        for k in counts:
            if places.get(k) == _HOLE:
                self._flip(k, _HELD)
        return True

    def _flip(self, k: int, where: int) -> None:
        """Extent ``k`` became held or a hole: move its bucket to the other heap."""
        if self._where.get(k, where) == where:
            return
        self._where[k] = where
        n = len(self._buckets[k])
        self._num_ready += n if where == _HELD else -n
        heapq.heappush(self._held if where == _HELD else self._holes, k)

    def _push(self, slots: list[int]) -> dict[int, int]:
        """Bucket free slots (below ``_fresh``) by extent; returns the extents they touch
        (``ExtentMap.touched``), counted on the way."""
        if not slots:
            return {}
        off, bb, ext = self._off, self._bb, self._ext
        ordered = sorted(slots)  # NOTE: faster than min() and max() on a list of ints
        lo, hi = ordered[0], ordered[-1]
        if lo < 0 or hi >= self._fresh:
            raise ValueError(f"slots to free must be in [0, {self._fresh}) (handed out), got {lo}..{hi}")
        k = (off + lo * bb) // ext
        if not self._wide and k == (off + hi * bb) // ext:  # one extent's slots: no loop
            ordered.reverse()  # a bucket descends: ``allocate`` pops ascending runs
            self._bucket(k).extend(ordered)
            if self._where[k] == _HELD:
                self._num_ready += len(slots)
            self._num_bucketed += len(slots)
            counts = {k: len(slots)}
            if (off + (hi + 1) * bb - 1) // ext != k:
                counts[k + 1] = 1
            return counts
        if self._wide:
            for s in slots:
                self._bucket((off + s * bb) // ext).append(s)
            self._num_ready += sum(1 for s in slots if self._where[(off + s * bb) // ext] == _HELD)
            self._num_bucketed += len(slots)
            return self.extents.touched(slots)
        counts: dict[int, int] = {}  # each extent's slots are one slice of ``ordered``
        i, n = 0, len(ordered)
        while i < n:
            k = (off + ordered[i] * bb) // ext
            first_next = -(-((k + 1) * ext - off) // bb)  # the first slot starting past extent k
            j = bisect.bisect_left(ordered, first_next, i)
            self._bucket(k).extend(reversed(ordered[i:j]))
            if self._where[k] == _HELD:
                self._num_ready += j - i
            counts[k] = counts.get(k, 0) + j - i
            if ordered[j - 1] == first_next - 1 and off + first_next * bb > (k + 1) * ext:
                counts[k + 1] = counts.get(k + 1, 0) + 1  # it runs over into the next extent
            i = j
        self._num_bucketed += n
        return counts

    def _bucket(self, k: int) -> list[int]:
        bucket = self._buckets.get(k)
        if bucket is None:
            self._buckets[k] = bucket = []
            where = self._where[k] = _HELD if self.extents.is_allocated(k) else _HOLE
            heapq.heappush(self._held if where == _HELD else self._holes, k)
        return bucket

    # -- free, quarantine, shrink -------------------------------------------------------------

    def free(self, slots: list[int]) -> None:
        """Return slots no durable record names: allocatable, and given back to the file.

        Raises ValueError: a slot that was never handed out (nothing freed)."""
        if not slots:
            return
        em, off, bb, ext = self.extents, self._off, self._bb, self._ext
        ordered = sorted(slots)  # NOTE: faster than min() and max() on a list of ints
        lo, hi = ordered[0], ordered[-1]
        k = (off + lo * bb) // ext
        if self._wide or lo < 0 or hi >= self._fresh or k != (off + hi * bb) // ext:
            self.file.give_back(slots, touched=self._push(slots))
        else:  # one extent's slots (the common case), inline
            bucket = self._buckets.get(k)
            if bucket is None:
                bucket = self._bucket(k)
            ordered.reverse()  # a bucket descends: ``allocate`` pops ascending runs
            bucket.extend(ordered)
            n = len(ordered)
            if self._where[k] == _HELD:
                self._num_ready += n
            self._num_bucketed += n
            em.add_users_of(k, -n)
            last = (off + (hi + 1) * bb - 1) // ext
            if last != k:
                em.add_users_of(last, -1)
        if em.num_idle > self.keep_idle:
            self.shrink(self.keep_idle)

    def defer_free(self, slots: list[int]) -> None:
        """Return slots that a durable record may still name (``SlotAllocator.defer_free``)."""
        self._quarantine.add(slots)

    def seal_deferred(self, mark: int) -> None:
        """Raises ValueError: ``mark`` below the last sealed batch's (see ``SlotAllocator``)."""
        self._quarantine.seal(mark)

    def next_deferred_mark(self) -> int | None:
        return self._quarantine.next_mark()

    def release_deferred(self, upto: int) -> int:
        """Make every sealed batch with ``mark <= upto`` allocatable; returns how many slots."""
        released = self._quarantine.release(upto)
        self.free(released)
        return len(released)

    def release_all_deferred(self) -> int:
        """Make every quarantined slot allocatable, sealed or not; returns how many."""
        released = self._quarantine.release_all()
        self.free(released)
        return len(released)

    def shrink(self, keep_idle: int = 0) -> int:
        """Punch the idle extents above the ``keep_idle`` lowest; returns the bytes given back."""
        if self.extents.num_idle <= keep_idle or (self.may_shrink is not None and not self.may_shrink()):
            return 0
        idle = self.extents.idle()
        freed = self.file.shrink(keep_idle)
        for k in idle[keep_idle:]:
            if not self.extents.is_allocated(k):
                self._flip(k, _HOLE)
        return freed

    # -- recovery -----------------------------------------------------------------------------

    def take(self, slots) -> None:
        """Mark specific slots used (recovery); the first call is the file's ``recover``.

        Raises:
            ValueError: a slot out of range, not free, or given twice.
            BudgetExceededError, NoSpaceError: see ``SparsePoolFile.recover``.
        """
        wanted = np.asarray(slots, dtype=np.int64).reshape(-1)
        if wanted.size and (wanted.min() < 0 or wanted.max() >= self.num_slots):
            raise ValueError(f"slots out of range [0, {self.num_slots}): "
                             f"{sorted(wanted[(wanted < 0) | (wanted >= self.num_slots)].tolist())[:8]}")
        if wanted.size and np.bincount(wanted, minlength=self.num_slots).max() > 1:
            raise ValueError("a slot to take is given twice")
        is_free = np.zeros(self.num_slots, dtype=bool)
        is_free[self._fresh:] = True
        for bucket in self._buckets.values():
            is_free[bucket] = True
        if not is_free[wanted].all():
            raise ValueError("some slots to take are not free")
        if not self._recovered:
            self.file.recover(wanted)
            self._recovered = True
        elif wanted.size and not self._grow_for(wanted.tolist(), self.extents.touched(wanted)):
            raise ValueError("the extents of the slots to take cannot grow")
        is_free[wanted] = False
        top = int(wanted.max()) + 1 if wanted.size else 0
        fresh = max(self._fresh, top)
        rest = np.flatnonzero(is_free[:fresh])[::-1].tolist()  # lowest slots on top of each stack
        self._buckets, self._where, self._held, self._holes = {}, {}, [], []
        self._num_ready = self._num_bucketed = 0
        self._fresh = fresh
        self._push(rest)

    def used_slots(self) -> set[int]:
        free = {s for b in self._buckets.values() for s in b}
        return set(range(self._fresh)) - free - set(self._quarantine.slots())

    def check_invariants(self) -> None:
        free = [s for b in self._buckets.values() for s in b]
        deferred = self._quarantine.slots()
        self._quarantine.check_invariants()
        both = free + deferred
        assert len(set(both)) == len(both), "a slot is free or deferred twice"
        assert all(0 <= s < self._fresh for s in both), "a free slot is out of range or never used"
        assert len(free) == self._num_bucketed, "bucketed count drifted"
        em = self.extents
        ready = 0
        for k, bucket in self._buckets.items():
            assert bucket, f"empty bucket {k}"
            assert self._where[k] == (_HELD if em.is_allocated(k) else _HOLE), f"extent {k} misfiled"
            assert all(self.extent_of(s) == k for s in bucket), f"bucket {k} holds another's slot"
            ready += len(bucket) if em.is_allocated(k) else 0
        assert ready == self._num_ready, f"ready count drifted: {self._num_ready} != {ready}"
        assert set(self._where) == set(self._buckets)
        if self._recovered:
            used = sorted(self.used_slots() | set(deferred))
            assert em.touched(used) == {k: em.users_of(k) for k in range(em.num_extents) if em.users_of(k)}, \
                "the extent map's users differ from the slots in use"
        self.file.check_invariants()
