"""Vertical scheduling of a :class:`perseus.torch.DistributedEmbedding`: :meth:`~VerticalScheduling.prefetch`
declares the ids of the next forward, so that the next backward sends at once the gradient rows that forward
reads and defers the others to the background (merged into the gradient of the backward after).

``prefetch`` is collective: every rank of the table's process set calls it (an allgather of the ids); it raises
TypeError for ids that are not a tensor and IndexError (on every rank) for ids out of range. A forward that
would read a row whose deferred gradient no optimizer step has applied yet raises RuntimeError on every rank;
:meth:`~VerticalScheduling.flush` (not collective) adds a pending deferred gradient to ``weight.grad`` at once.
"""

from __future__ import annotations

from typing import Optional

import torch

from perseus.torch._tensors import synchronize

__all__ = ["VerticalScheduling"]


class VerticalScheduling:
    """The vertical-scheduling methods of :class:`perseus.torch.DistributedEmbedding`, placed before
    ``nn.Module`` in its bases. They use the embedding's ``weight``, ``_size``, ``_next``, ``_next_set``,
    ``_prefetched``, ``_deferred`` and ``_unapplied``, its collectives (``_allgather``, ``_priorities``,
    ``_what``), ``_check_ids`` and ``_shard_gradient``."""

    def prefetch(self, next_input: Optional[torch.Tensor]) -> None:
        """Declare the ids of this table's next forward (this rank's part), so that the next backward sends
        first the gradient rows that forward reads and defers the others (vertical scheduling).

        Call it between a forward and its backward, typically with the batch the data loader has already
        prepared; the next backward uses it once. ``None`` (on any rank) defers nothing: pass it for the
        last batch, so every row is applied at the last step. Collective: every rank of the process set
        calls it (an allgather of the ids).

        The rows deferred by a backward are sent in the background with the lowest priority, waited for by
        the next backward and added to its gradient, so the optimizer applies them one step later. They are
        the rows no rank's declared next forward reads, so the result equals training without deferral for
        optimizers that leave rows with a zero gradient unchanged and whose per-row update does not depend on
        the step count (SGD without momentum or weight decay, Adagrad); for SparseAdam the deferred rows get
        the next step's bias correction; dense Adam or momentum move rows without a gradient, so do not use
        prefetch with them. A forward that would read a row whose deferred gradient has not been applied yet
        (ids other than those declared, or no optimizer step in between) raises RuntimeError on every rank;
        :meth:`flush` adds a pending deferred gradient to ``weight.grad`` at once.

        The ids gathered here are not sent again: in the next forward a rank whose ids are the ones it
        declared sends a one-element flag instead (ids that differ are sent in full, and are fine).
        """
        if self._size == 1:  # nothing travels, so nothing is deferred; the ids are still checked
            if next_input is not None:
                self._check_ids(next_input.reshape(-1).to(torch.int64), [next_input.numel()], "prefetch")
            return
        if next_input is None:
            flat = torch.zeros(1, dtype=torch.int64)  # flag 0: no next batch
        else:
            if not isinstance(next_input, torch.Tensor):
                raise TypeError(f"{self._what()}.prefetch: expected a tensor of token ids or None, got "
                                f"{type(next_input).__name__}")
            flat = torch.cat([torch.ones(1, dtype=torch.int64), next_input.detach().reshape(-1).to(torch.int64)])
        p_grad, _, _ = self._priorities()
        gathered, counts = self._allgather(flat, "next_ids", p_grad)
        starts = [sum(counts[:k]) for k in range(len(counts))]
        if any(int(gathered[s]) == 0 for s in starts):
            self._next, self._next_set, self._prefetched = None, True, None
            return
        keep = torch.ones(gathered.shape[0], dtype=torch.bool)
        keep[starts] = False
        ids = gathered[keep]
        self._check_ids(ids, [c - 1 for c in counts], "prefetch")
        self._next, self._next_set = torch.unique(ids), True
        self._prefetched = (flat[1:], list(ids.split([c - 1 for c in counts])))

    def _check_fresh(self, all_ids):
        at_risk = []
        if self._deferred is not None:
            at_risk.append(self._deferred.rows)
        if self._unapplied is not None:
            rows, version = self._unapplied
            if self.weight._version != version:
                self._unapplied = None
            else:
                at_risk.append(rows)
        if not at_risk or all_ids.numel() == 0:
            return
        stale = torch.isin(all_ids, torch.cat(at_risk))
        if bool(stale.any()):
            raise RuntimeError(
                f"{self._what()}: this forward reads row {int(all_ids[stale][0])}, whose gradient an earlier "
                "backward deferred (vertical scheduling) and no optimizer step has applied yet: the ids differ "
                "from those given to prefetch(), or no optimizer step ran after the backward that merged them. "
                "Pass the next forward's ids to prefetch() (None for the last batch), step the optimizer after "
                "every backward, or call flush() and step. Every rank raises this error.")

    def flush(self) -> None:
        """Wait for the gradient rows the latest backward deferred and add them to ``weight.grad`` now (the
        next optimizer step applies them). Needed only when training stops after a backward that deferred
        rows (a backward after ``prefetch(ids)``); not a collective (the rows were sent already)."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return
        values = synchronize(deferred.handle).view(-1, self.weight.shape[1])
        grad = self._shard_gradient([deferred.rows], [values], self.weight.dtype)
        with torch.no_grad():
            if self.weight.grad is None:
                self.weight.grad = grad
            elif grad.is_sparse and not self.weight.grad.is_sparse:
                self.weight.grad.add_(grad.to_dense())
            else:
                self.weight.grad = self.weight.grad + grad
        self._unapplied = (deferred.rows, self.weight._version)
