"""The recall study's structural column: can an arm answer a question by pointing, without retrieving?

For every asked pair (MQAR) or needle, the share whose answer token is **alone** in a region the arm can use: the only
answer token (``generator.answer_ids``: MQAR's values, the needle's value bytes) among that region's members. A
query-independent summary of such a region (Combiner's pooled key and value, MoBA's mean key, NSA's compressed token)
already names the answer once the region is found, so the arm can answer by locating the region; where several answer
tokens share every region the query can use, it must read inside one. The **direct** share is the share whose answer
the query reads at full resolution whatever it does (its own segment, window, or forced blocks).

Both come from the generated examples (``RecallDataset.drawn``: each question's ``source``, the position of the token
holding its answer) and the arm's own geometry, one ``Partition`` per layer:

- Combiner variants and ``combiner_select``: ``attn.partition(L)`` (its regions are what a summary covers and what
  selection picks from);
- ``moba`` and ``nsa``: ``attn.selection_regions(L)`` (blocks a query may pick, NSA's compression blocks; direct = the
  own block, NSA's window and forced blocks);
- patterns without regions (``full``, ``local``, ``fixed``, ``axial``, ...): ``partition(L)`` has no region, so
  **alone** is not defined (NA: nothing is summarized) and **direct** is the share the pattern reads;
- attentions with neither (``linear``: a fixed-size state): both NA.

A hybrid (``model.layer_attention``) counts a question as alone (direct) when it is in some layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longseq.attention.ops.partition import Partition
from longseq.data.recall import RecallExample

NO_REGIONS = "no regions: every key it reads is read directly"
NO_GEOMETRY = "no regions and no direct keys (a fixed-size state)"


@dataclass
class Structure:
    """One arm at one setting: the shares (None where not defined), the questions counted and what NA means."""

    alone: float | None
    direct: float | None
    questions: int
    note: str = ""

    def cell(self) -> str:
        """``alone / direct`` with two decimals, ``NA`` where a share is not defined."""
        show = lambda x: "NA" if x is None else f"{x:.2f}"  # noqa: E731
        return f"{show(self.alone)} / {show(self.direct)}"


def arm_geometry(attention, length: int) -> Partition | None:
    """The ``Partition`` the structural column reads for one layer's attention: its selection regions (``moba``,
    ``nsa``), else its partition, else None (no geometry: ``linear`` and the other kernel / low-rank variants, and
    partitions that depend on the data, e.g. ``combiner_routing``'s clusters)."""
    if hasattr(attention, "selection_regions"):
        return attention.selection_regions(length)
    if hasattr(attention, "partition"):
        try:
            return attention.partition(length)
        except TypeError:  # a partition of the data (routing: clusters, routes), not of the length
            return None
    return None


def question_cells(examples: RecallExample) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(example, question position, answer position), each ``(Q,)`` long, for every question of ``examples``."""
    source = torch.as_tensor(examples.source)
    rows, where = (source >= 0).nonzero(as_tuple=True)
    return rows, where, source[rows, where]


def shares(part: Partition, examples: RecallExample, answer_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Per question ``(Q,)`` bool: its answer is alone (the only answer token) in a region its query may use; its
    answer is among its query's direct keys. ``examples``: (N, L) arrays with sources; ``answer_ids``: the tokens
    answers are drawn from."""
    rows, where, source = question_cells(examples)
    direct = part.direct[where, source]
    if part.members.shape[0] == 0:
        return torch.zeros_like(direct), direct
    inputs = torch.as_tensor(examples.inputs)
    is_answer = torch.isin(inputs, torch.as_tensor(answer_ids)).float()  # (N, L)
    counts = is_answer @ part.members.T.float()  # (N, R) answer tokens per region
    holds = part.members[:, source].T & part.usable[where]  # (Q, R) usable regions that hold the answer
    return (holds & (counts[rows] == 1)).any(-1), direct


def structure(attentions: list, examples: RecallExample, answer_ids, length: int) -> Structure:
    """The structural column of an arm whose layers use ``attentions`` (one per layer) on ``examples``."""
    parts = [arm_geometry(a, length) for a in attentions]
    n_questions = int((torch.as_tensor(examples.source) >= 0).sum())
    known = [p for p in parts if p is not None]
    if not known:
        return Structure(None, None, n_questions, NO_GEOMETRY)
    alone = direct = None
    for part in known:
        a, d = shares(part, examples, answer_ids)
        alone = a if alone is None else alone | a
        direct = d if direct is None else direct | d
    has_regions = any(p.members.shape[0] for p in known)
    note = "" if has_regions else NO_REGIONS
    if len(known) < len(parts):
        note = (note + "; " if note else "") + "a layer without geometry counts as neither"
    return Structure(float(alone.float().mean()) if has_regions else None, float(direct.float().mean()), n_questions,
                     note)


def structure_of_config(cfg, count: int = 500, seed: int = 1, split: str = "test") -> Structure:
    """The structural column of the run ``cfg`` describes (its arm's attention in every layer, its task's generator):
    over the first ``count`` examples of ``split`` of data seed ``seed`` (the recall study: its test split, seed 1)."""
    from omegaconf import OmegaConf

    from longseq.data.recall import GENERATORS, RecallDataset
    from longseq.utils.build import build_module

    module = OmegaConf.to_container(cfg.task.module, resolve=True)
    generator = GENERATORS[module["name"]](**module["generator"])
    examples = RecallDataset(generator, count, seed, split).drawn()
    net = build_module(cfg).net
    return structure([block.attn.attention for block in net.blocks], examples, generator.answer_ids,
                     generator.seq_len)
