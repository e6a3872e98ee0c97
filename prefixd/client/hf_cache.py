"""``PrefixdCache``: a transformers ``Cache`` whose K/V live in a prefixd session's mapped pool.

One sequence per prompt (its real tokens only: left padding is never a token), opened when the
cache is made, so a prefix an earlier request committed (any process, any engine, before a
daemon restart) is a hit. The cache reports the common cached columns as its length, so
``generate`` runs the model only on the columns past them; each forward's new K/V are stored
straight into the mapped pool by the attention function (``hf_attention``), which then attends
over the pool through the block tables. The public API is in ``prefixd.client.hf``.
"""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import Cache

from prefixd.client.errors import DaemonRestarted, InvalidArgument, MappingError
from prefixd.client.hf_attention import ATTENTION_NAME, PagedKVContext, offer, register_hf_attention

log = logging.getLogger(__name__)


def layout_fields(model) -> dict:
    """The KV layout fields (no model id, no block size) a transformers decoder needs."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"num_layers": config.num_hidden_layers,
            "num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": head_dim, "dtype": str(model.dtype).removeprefix("torch.")}


def _prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[list[list[int]], list[int]]:
    """Each row's real tokens and its left padding; refuses padding anywhere but on the left."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise InvalidArgument(f"input_ids must be [batch, length>0], got {tuple(input_ids.shape)}")
    ids = input_ids.tolist()
    if attention_mask is None:
        return ids, [0] * len(ids)
    mask = attention_mask.tolist()
    prompts, pads = [], []
    for row, m in zip(ids, mask):
        pad = len(m) - sum(m)
        if any(m[:pad]) or not all(m[pad:]) or pad == len(m):
            raise InvalidArgument("PrefixdCache takes left-padded prompts (tokenizer.padding_side='left'), each "
                                  f"with a token; got an attention mask row {m}")
        prompts.append(row[pad:])
        pads.append(pad)
    return prompts, pads


class PrefixdCache(Cache):
    """A transformers cache over one prefixd sequence per batch row (see ``prefixd.client.hf``).

    Lifecycle: made (opens one sequence per prompt; switches the model's attention to
    ``prefixd_paged``) -> the first forward (prefill: only tokens past each prompt's usable cached
    prefix are computed and written) -> at the second forward, the prompts' full blocks are
    committed and, when ``generate`` expanded each prompt into ``n`` rows
    (``num_return_sequences``), each prompt's sequence is forked into ``n`` children (the parent is
    released after their first extend) -> each decode forward extends every row's sequence by its
    token first, then the attention writes the token's K/V -> ``close`` releases every sequence (committing its full
    blocks unless the generation failed) and gives the model its attention back.

    Invariants: a token is added to a daemon sequence only by the forward that writes its K/V, so
    every full block of a live sequence holds real K/V and may be committed; a store goes only to
    tokens at or past ``num_indexed * block_size`` and past what a fork may share (checked before
    each decode step); ``get_seq_length()`` counts the columns of ``input_ids`` the cache holds
    (the common skipped prefix, then every forwarded column), as ``DynamicCache`` does.

    NOTE: a prompt must compute at least its last token (its logits start generation). The daemon
    serves at most ``len - 1`` tokens, in whole blocks, so a prompt of whole cached blocks
    recomputes its last block; were a prompt served whole, its last token would be attended for
    from the pool and not stored again (``write_from``: its block is committed). Rows of one batch skip only the columns every row has cached (``generate`` slices one
    ``input_ids`` for all rows); a row with more cached computes those columns but neither
    attends for them nor stores them.
    """

    def __init__(self, session, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 durability: str = "crash", backend: str = "auto") -> None:
        super().__init__(layers=[])
        self.session = session
        self.model = model
        self.durability = durability
        self.backend = backend
        layout = session.layout
        want = layout_fields(model)
        got = {k: getattr(layout, k) for k in want}
        if got != want:
            raise InvalidArgument(f"the session's layout {got} does not match the model's KV {want}: connect with "
                                  "prefixd.client.hf.layout_for(model, model_id)")
        if session.pool is None:
            raise MappingError("PrefixdCache attends over the mapped pool: connect with mapped=True on the daemon's "
                               "host (the KV rpcs would copy every layer's K/V through the socket)")
        if session.pool.tensor.device != model.device:
            raise InvalidArgument(f"the pool is on {session.pool.tensor.device} and the model on {model.device}: "
                                  "run the model where the daemon's device tier is")
        self.block_size = layout.block_size
        self.prompts, self.pads = _prompts(input_ids, attention_mask)
        self.width = input_ids.shape[1]
        self.parents = self._open_all()
        # NOTE: taken after the opens: a recovery (daemon restart) remaps the pool, and K/V stored
        # into the previous mapping would never reach the daemon's blocks.
        self.pool = session.pool
        # Tokens of each prompt not computed again: the cached prefix, less at least one token.
        self.usable = [min(s.cached_tokens, len(p) - 1) for s, p in zip(self.parents, self.prompts)]
        self.skip = min(pad + use for pad, use in zip(self.pads, self.usable))
        self.rows = None  # the sequence of each batch row once prefill is committed (and forked)
        self.copies = 1
        self.forwards = 0
        self.columns = self.skip
        self.forward_tokens = 0  # token positions the model ran on (all rows, all forwards)
        self.closed = False
        self._context: PagedKVContext | None = None
        config = model.config
        self._previous_attention = config._attn_implementation
        try:
            model.set_attn_implementation(register_hf_attention())
            self._hook = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        except BaseException:
            model.set_attn_implementation(self._previous_attention)
            self._release_all(self.parents, commit=False, quiet=True)
            raise
        log.debug("prefixd cache prompts=%s cached=%s skip=%s", [len(p) for p in self.prompts],
                  [s.cached_tokens for s in self.parents], self.skip)

    def _open_all(self) -> list:
        """One sequence per prompt; opened again once if the daemon restarted meanwhile.

        NOTE: a daemon restart right before a request (``kill -9`` and back) makes the first call
        that meets it raise ``DaemonRestarted`` even though the session has recovered; an open
        is safe to redo (nothing was written yet), so the cache releases what it opened and
        opens again, and the request gets the committed prefix as a hit.
        """
        for attempt in (1, 2):
            opened = []
            try:
                for tokens in self.prompts:
                    opened.append(self.session.open(tokens))
                return opened
            except DaemonRestarted as exc:
                self._release_all([s for s in opened if not s.lost], commit=False, quiet=True)
                if attempt == 2:
                    raise
                log.info("daemon restarted while opening prompts (%s); opening again", exc)
            except BaseException:
                self._release_all(opened, commit=False, quiet=True)
                raise
        raise AssertionError("unreachable")

    # -- what callers read ---------------------------------------------------------------------

    @property
    def prompt_tokens(self) -> int:
        """Real prompt tokens of the batch (padding excluded, one copy per prompt)."""
        return sum(len(p) for p in self.prompts)

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose K/V came from the daemon instead of the model."""
        return sum(self.usable)

    @property
    def cached_tokens(self) -> list[int]:
        """Each prompt's cached tokens as the daemon answered at open."""
        return [s.cached_tokens for s in self.parents]

    # -- the transformers Cache interface ------------------------------------------------------

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Hand this step's context to the layer's attention; the K/V go to the pool there."""
        if self._context is None:
            raise RuntimeError("PrefixdCache.update outside a forward the cache saw begin (closed, or a forward "
                               "of another model)")
        offer(self._context, layer_idx)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.columns + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("PrefixdCache does not do beam search (num_beams=1); sample or decode greedily")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("PrefixdCache cannot be cropped (no assisted decoding)")

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("PrefixdCache forks its sequences itself; pass num_return_sequences to generate")

    def batch_select_indices(self, indices):
        raise NotImplementedError("PrefixdCache cannot drop rows")

    def reset(self) -> None:
        raise NotImplementedError("PrefixdCache cannot be reset: make a new one per request")

    # -- one forward ---------------------------------------------------------------------------

    def _before_forward(self, module, args, kwargs):
        if kwargs.get("past_key_values") is not self:
            return None
        if self.closed:
            raise RuntimeError("this PrefixdCache is closed: make a new one per request")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or ids.dim() != 2:
            raise InvalidArgument("PrefixdCache needs input_ids [batch, length] (not inputs_embeds)")
        self._context = None
        if self.session.pool is not self.pool:
            raise DaemonRestarted("the session re-attached and remapped the pool during this request: run the "
                                  "request again with a new PrefixdCache", [])
        if self.forwards == 0:
            self._context = self._prefill_context(ids)
        else:
            if self.rows is None:
                self._finish_prefill()
            self._context = self._decode_context(ids)
        self.forwards += 1
        self.columns += ids.shape[1]
        self.forward_tokens += ids.numel()
        return None

    def _prefill_context(self, ids: torch.Tensor) -> PagedKVContext:
        num_rows, width = ids.shape
        if num_rows % len(self.prompts) or width != self.width - self.skip:
            raise InvalidArgument(f"the first forward got input_ids {tuple(ids.shape)}; the cache expects "
                                  f"{len(self.prompts)} x k rows of {self.width - self.skip} columns (call generate "
                                  "with the input_ids and attention_mask the cache was made with)")
        self.copies = num_rows // len(self.prompts)
        tables, lens, counts, write_from = [], [], [], []
        got = ids.tolist()
        for r in range(num_rows):
            p, copy = divmod(r, self.copies)
            seq, prompt, use = self.parents[p], self.prompts[p], self.usable[p]
            new = len(prompt) - use
            if got[r][width - new:] != prompt[use:]:
                raise InvalidArgument(f"row {r} of the first forward is not prompt {p}'s tokens past its cached "
                                      "prefix: call generate with the input_ids the cache was made with")
            tables.append(seq.block_table)
            lens.append(len(prompt))
            counts.append(new)
            write_from.append(max(use, seq.num_indexed * self.block_size) if copy == 0 else len(prompt))
        return self._context_for(tables, lens, counts, width, write_from)

    def _finish_prefill(self) -> None:
        """Commit the prompts' full blocks, then fork each into its rows (``num_return_sequences``)."""
        for seq in self.parents:
            self.session.commit(seq, durability=self.durability)
        if self.copies == 1:
            self.rows = list(self.parents)
            return
        rows = []
        for seq in self.parents:
            rows.extend(self.session.fork(seq, self.copies))
        self.rows = rows  # the parents are released after the first decode step's extends

    def _decode_context(self, ids: torch.Tensor) -> PagedKVContext:
        if ids.shape != (len(self.rows), 1):
            raise InvalidArgument(f"a decode forward got input_ids {tuple(ids.shape)}, expected "
                                  f"({len(self.rows)}, 1)")
        bs = self.block_size
        for seq, token in zip(self.rows, ids[:, 0].tolist()):
            self.session.extend(seq, [token])
            block = (seq.num_tokens - 1) // bs
            if block < seq.num_indexed or block < seq.shared_blocks():
                raise RuntimeError(f"sequence {seq.id}: the new token's block {block} is shared after extend "
                                   f"({seq!r}); refusing to store into it")
        if self.copies > 1 and not self.parents[0].released:
            # NOTE: a parent held until every child extended makes each child's extend copy the
            # shared partial block (refcount >= 2), so the handle sees a new slot and knows the
            # block is its own; with the parent released first, the last child to extend keeps
            # the original slot and only the daemon would know that it is no longer shared.
            self._release_all(self.parents, commit=False)
        return self._context_for([s.block_table for s in self.rows], [s.num_tokens for s in self.rows],
                                 [1] * len(self.rows), 1, None)

    def _context_for(self, tables, lens, counts, width, write_from) -> PagedKVContext:
        table = torch.zeros((len(tables), max(len(t) for t in tables)), dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        return PagedKVContext.for_rows(self.pool.tensor, table, torch.tensor(lens, dtype=torch.int32), counts, width,
                                       write_from, backend=self.backend)

    # -- the end -------------------------------------------------------------------------------

    def close(self, commit: bool = True, quiet: bool = False) -> None:
        """Release every sequence (committing full blocks when ``commit`` and a forward ran);
        give the model its attention back. Idempotent. Raises the first failed release unless
        ``quiet``."""
        if self.closed:
            return
        self.closed = True
        self._hook.remove()
        self.model.set_attn_implementation(self._previous_attention)
        self._context = None
        live = self.parents + (self.rows or [])
        self._release_all(live, commit=commit and self.forwards > 0, quiet=quiet)

    def _release_all(self, seqs, commit: bool, quiet: bool = False) -> None:
        """Release each of ``seqs`` still live; raise the first failure after trying all
        (none when ``quiet``: the caller is already raising)."""
        error = None
        for seq in seqs:
            if seq.released or seq.lost:
                continue
            try:
                try:
                    self.session.release(seq, commit=commit, durability=self.durability)
                except DaemonRestarted:  # told once per changed handle; the release itself is due,
                    if not (seq.released or seq.lost):  # not a commit: its K/V may be in an old mapping
                        self.session.release(seq, commit=False)
            except Exception as exc:
                log.warning("release of sequence %s failed: %s", seq.id, exc)
                error = error or exc
        if error is not None and not quiet:
            raise error

    def __enter__(self) -> "PrefixdCache":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(commit=exc_type is None, quiet=exc_type is not None)

    def check_invariants(self) -> None:
        assert self.skip <= self.columns, (self.skip, self.columns)
        for seq in self.rows or self.parents:
            if not seq.released:
                seq.check_invariants()
        if self.closed:
            config = self.model.config
            assert config._attn_implementation != ATTENTION_NAME or self._previous_attention == ATTENTION_NAME
