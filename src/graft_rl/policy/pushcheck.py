"""Verify a weight push into a rollout engine against the trainer's own parameters (docs/design.md,
layer 3; SPEC §1.10).

A push streams the trainer's tensors into the engine, which renames, fuses (``q_proj``, ``k_proj``,
``v_proj`` → ``qkv_proj``; ``gate_proj``, ``up_proj`` → ``gate_up_proj``), pads (vocabulary rows) and
casts them. Whether every engine tensor then holds the trainer's values is checked with a
**row digest**: per row (dim 0) of a tensor, the integer sum of the bit patterns of its values in the
engine's dtype (a 1-D tensor: one row per element). It is

- *exact*: a value that differs in any bit (a stale bf16 value, a zeroed or uninitialised tensor)
  changes its row's sum, unless the changes of one row cancel exactly;
- *additive*: the rows of an engine tensor fused along dim 0 are the concatenated rows of its parts,
  and the rows of an FSDP2 shard (``Shard(0)``) are a block of the full tensor's, so sharded ranks
  and fused tensors compose to the same figures without gathering a weight.

Two engine layouts are not the trainer's rows:

- *transposed*: transformers' ``Conv1D`` (GPT-2) stores ``[in, out]``; vLLM's linear layers hold the
  transpose. Such an engine tensor is digested by *columns* in the engine (:attr:`EngineLayout.columns`),
  which are the trainer's rows: the trainer side is unchanged.
- *shared*: a tied alias (``lm_head.weight`` tied to the embeddings) has no tensor of its own in the
  engine: vLLM ties its head to the embedding's parameter. Where it lands is found in the engine, by
  storage, not assumed (:attr:`EngineLayout.aliases`), and what *enters* the engine under the alias is
  digested at the engine's door (:func:`delivery`), so an alias left out of a push, or altered on its
  way, is refused even where the engine reads nothing of it.

The reference is the trainer's parameters themselves, cast to each engine tensor's dtype (not the
stream the push sent, which would verify a corrupted stream against itself). Quantised engines
(fp8) store other values than the trainer's, so only *coverage* is checked there: every engine tensor
whose trainer tensors changed since the last push changed too (:func:`stale_coverage`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

__all__ = [
    "BIT_VIEWS",
    "EngineLayout",
    "engine_layout",
    "engine_digest",
    "row_digest",
    "compare",
    "delivery",
    "digesting",
    "entering",
    "stale_coverage",
    "state_digest",
    "tied_names",
    "transposed_names",
]

#: Integer dtype of the same width as each float dtype: its bit pattern, summed exactly in int64.
BIT_VIEWS = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float64: torch.int64,
}

#: Elements digested at a time (bounds the int64 copy a digest makes: 512 MB).
_CHUNK = 1 << 26


def row_digest(t: torch.Tensor, dtype: torch.dtype | None = None, columns: bool = False) -> torch.Tensor:
    """Int64 ``[rows]``: each row's sum of the bit patterns of ``t`` cast to ``dtype`` (default: its own).

    ``t`` 2-D or more: rows are dim 0; 1-D: each element a row; 0-D: one row. Float dtypes are read
    through :data:`BIT_VIEWS`; integer and 8-bit dtypes (fp8) as their own bytes. Exact: no rounding,
    and the sum of ``2**26`` int32 patterns fits int64 with room to spare. ``columns`` (2-D ``t``): each
    column's sum instead, the row digest of ``t.T`` without a transposed copy.
    """
    x = t.detach()
    if dtype is not None and x.dtype != dtype:
        x = x.to(dtype)
    if x.dim() == 0:
        x = x.reshape(1)
    x = x.reshape(x.shape[0], math.prod(x.shape[1:])) if x.dim() > 1 else x.reshape(-1, 1)
    if not x.is_contiguous():
        x = x.contiguous()
    view = BIT_VIEWS.get(x.dtype) or (torch.int8 if x.element_size() == 1 else None)
    bits = x.view(view) if view is not None else x
    rows = max(1, _CHUNK // max(1, x.shape[1]))
    if columns:
        out = torch.zeros(x.shape[1], dtype=torch.int64, device=x.device)
        for s in range(0, x.shape[0], rows):
            out += bits[s : s + rows].to(torch.int64).sum(dim=0)
        return out.cpu()
    out = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    for s in range(0, x.shape[0], rows):
        out[s : s + rows] = bits[s : s + rows].to(torch.int64).sum(dim=1)
    return out.cpu()


@dataclass
class EngineLayout:
    """Where each trainer tensor lands in the engine (computed once, in the engine's worker).

    ``parts[engine name]``: the trainer names whose rows the engine tensor holds, in row order (one
    name, or the parts of a fused tensor); ``dtypes[engine name]``; trainer names the engine's loader
    drops (its name mapper maps them to nothing, e.g. rotary buffers) are left out; ``aliases[trainer
    name]``: the engine tensor a tied alias shares its storage with (found by storage in the engine);
    ``columns``: engine tensors holding their one part transposed (``Conv1D``), digested by column;
    ``unplaced``: trainer names with no engine tensor at all; ``quantized``: values are not compared.
    """

    parts: dict[str, list[str]] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    columns: set[str] = field(default_factory=set)
    unplaced: list[str] = field(default_factory=list)
    quantized: bool = False

    def trainer_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype each trainer tensor a push carries is digested in: its engine tensor's (an alias: the
        tensor it shares)."""
        out = {t: self.dtypes[e] for e, ts in self.parts.items() for t in ts}
        out.update({a: self.dtypes[e] for a, e in self.aliases.items()})
        return out


def _model_of(worker) -> torch.nn.Module:
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def engine_layout(
    model: torch.nn.Module,
    trainer_names: Iterable[str],
    quantized: bool = False,
    tied: Iterable[str] = (),
    transposed: Mapping[str, tuple] | None = None,
) -> EngineLayout:
    """Place each trainer tensor name in ``model``'s parameters as vLLM's own loader does: the model's
    ``hf_to_vllm_mapper`` (renames; ``None`` = dropped), then its ``packed_modules_mapping`` (a part's
    rows at its index among the fused tensor's parts).

    ``tied``: the trainer's aliases. One the engine has no parameter of its own for (``named_parameters``
    lists a shared tensor once) is followed to the tensor its module holds (``lm_head.weight``: the
    head's ``weight``), and placed in :attr:`EngineLayout.aliases` only if that is the storage of an
    engine parameter; else it stays unplaced. ``transposed``: trainer names stored transposed
    (``Conv1D``) with their trainer shapes; each that lands in an engine module other than a ``Conv1D``
    must land alone in a tensor of the reversed shape, which is then digested by column."""
    params = dict(model.named_parameters())
    tied = set(tied)
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", None) or {}
    slots: dict[str, dict[int, str]] = {}
    layout = EngineLayout(dtypes={n: p.dtype for n, p in params.items()}, quantized=quantized)
    for t in trainer_names:
        name = mapper.map_name(t) if mapper is not None and hasattr(mapper, "map_name") else t
        if name is None:  # dropped by the engine's loader
            continue
        placed = _place(name, t, params, packed)
        if placed is None:
            shared = _shared_param(model, name, params) if t in tied else None
            if shared is None:
                layout.unplaced.append(t)
            else:
                layout.aliases[t] = shared
            continue
        eng, index = placed
        slots.setdefault(eng, {})[index] = t
    layout.parts = {e: [by_index[i] for i in sorted(by_index)] for e, by_index in slots.items()}
    for t, shape in (transposed or {}).items():
        eng = next((e for e, ts in layout.parts.items() if t in ts), None)
        if eng is None or type(model.get_submodule(eng.rpartition(".")[0])).__name__ == "Conv1D":
            continue  # not placed, or the engine keeps the trainer's Conv1D layout
        if layout.parts[eng] != [t] or tuple(params[eng].shape) != tuple(shape)[::-1]:
            layout.unplaced.append(t)  # a transposed tensor fused with others, or not stored transposed
            continue
        layout.columns.add(eng)
    for e in params:  # an engine tensor nothing is pushed into: listed with no parts
        layout.parts.setdefault(e, [])
    return layout


def _shared_param(model: torch.nn.Module, name: str, params: Mapping[str, torch.Tensor]) -> str | None:
    """The engine parameter whose storage the tensor at ``name`` (a module path and attribute, resolved
    on the modules, where a tied head's ``weight`` is) is, or None."""
    module_name, _, attr = name.rpartition(".")
    try:
        t = getattr(model.get_submodule(module_name), attr)
    except AttributeError:
        return None
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return None
    for e, p in params.items():
        if p.data_ptr() == t.data_ptr() and p.shape == t.shape and p.dtype == t.dtype:
            return e
    return None


def _place(name: str, original: str, params: Mapping, packed: Mapping[str, list[str]]) -> tuple[str, int] | None:
    """``(engine tensor, index among its fused parts)`` for one mapped trainer name, or None."""
    for fused, parts in packed.items():
        for i, part in enumerate(parts):
            seg = f".{part}."
            if seg in f".{original}" or seg in f".{name}":  # a part: its fused tensor, at its index
                cand = f".{name}".replace(seg, f".{fused}.", 1)[1:] if seg in f".{name}" else name
                if cand in params:
                    return cand, i
    if name in params:
        return name, 0
    return None


def engine_digest(worker, columns: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Run in the engine's worker (``collective_rpc``): the row digest of each of its parameters, in
    its own dtype, on CPU; ``columns`` (transposed tensors, :attr:`EngineLayout.columns`) by column."""
    columns = set(columns)
    return {n: row_digest(p, columns=n in columns) for n, p in _model_of(worker).named_parameters()}


def compare(layout: EngineLayout, trainer: Mapping[str, torch.Tensor], engine: Mapping[str, torch.Tensor]) -> list[str]:
    """What differs between the engine's digests and the trainer's, one phrase per engine tensor.

    An engine tensor's rows must equal its parts' concatenated trainer rows; extra engine rows
    (vocabulary padding, never sampled) are not compared. A tied alias's engine tensor is its target's,
    compared as that (:attr:`EngineLayout.aliases`). Empty when the push is verified."""
    problems = []
    for eng, parts in layout.parts.items():
        if not parts:
            problems.append(f"{eng} receives no trainer tensor")
            continue
        if any(p not in trainer for p in parts):
            problems.append(f"{eng} has no trainer digest for {', '.join(p for p in parts if p not in trainer)}")
            continue
        want = torch.cat([trainer[p] for p in parts])
        got = engine.get(eng)
        if got is None:
            problems.append(f"{eng} was not digested in the engine")
        elif got.numel() < want.numel():
            problems.append(f"{eng} has {got.numel()} rows, the trainer's {', '.join(parts)} {want.numel()}")
        else:
            bad = (got[: want.numel()] != want).nonzero().flatten()
            if bad.numel():
                problems.append(f"{eng} differs from the trainer's {_which(parts, trainer, bad)}")
    return problems


def delivery(
    layout: EngineLayout, trainer: Mapping[str, torch.Tensor], entered: Mapping[str, torch.Tensor | None]
) -> list[str]:
    """What a push failed to deliver, one phrase per tensor: every trainer tensor of ``layout`` must have
    entered the engine (``entered``: the names the engine's loader read, each alias with the row digest
    of the tensor as it entered), and each alias as the trainer holds it. Engine digests cannot see
    an alias (it has no tensor of its own) nor what an engine derives from one without reading it
    anew (vLLM's CPU build packs its head's weights when the head is loaded): so it is checked here,
    at the engine's door. Empty when everything arrived."""
    problems = [f"{t} was not pushed" for t in layout.trainer_dtypes() if t not in entered]
    for alias in layout.aliases:
        got, want = entered.get(alias), trainer.get(alias)
        if got is not None and want is not None and not torch.equal(got, want):
            k = int((got != want).sum()) if got.shape == want.shape else want.numel()
            problems.append(f"{alias} as pushed differs from the trainer's ({k} of {want.numel()} rows)")
    return problems


def entering(stream, aliases: Mapping[str, torch.dtype], entered: dict):
    """``stream`` as the engine's loader reads it, recording in ``entered`` each name that passes (an
    alias of ``aliases`` with the row digest of its tensor in its engine dtype): :func:`delivery`'s
    evidence. A tensor the stream yields but the loader never asks for is not recorded."""
    for name, t in stream:
        entered[name] = row_digest(t, aliases[name]) if name in aliases else None
        yield name, t


def _which(parts: list[str], trainer: Mapping[str, torch.Tensor], bad: torch.Tensor) -> str:
    """``name (k of n rows)`` for each trainer part whose rows differ."""
    out, start = [], 0
    for p in parts:
        n = trainer[p].numel()
        k = int(((bad >= start) & (bad < start + n)).sum())
        if k:
            out.append(f"{p} ({k} of {n} rows)")
        start += n
    return ", ".join(out)


def stale_coverage(
    layout: EngineLayout,
    trainer_now: Mapping[str, torch.Tensor],
    trainer_before: Mapping[str, torch.Tensor],
    engine_now: Mapping[str, torch.Tensor],
    engine_before: Mapping[str, torch.Tensor],
) -> list[str]:
    """Coverage for a quantised engine: each engine tensor one of whose trainer tensors changed since the
    last push must have changed too (digests in each side's own dtype)."""
    problems = []
    for eng, parts in layout.parts.items():
        if not parts:
            continue  # scales and other quantisation state: not pushed
        moved = any(not torch.equal(trainer_now[p], trainer_before[p]) for p in parts if p in trainer_before)
        if moved and eng in engine_before and torch.equal(engine_now[eng], engine_before[eng]):
            problems.append(f"{eng} did not change although the trainer's {', '.join(parts)} did")
    return problems


def digesting(stream, dtypes: dict | None, digests: dict | None):
    """``stream``'s ``(name, tensor)`` pairs, each cast to its engine dtype where ``dtypes`` names one (the
    cast vLLM's loader would make, done before the tensor leaves: a sharded policy then gathers the
    engine's dtype, not its float32 masters), and, when ``digests`` is a dict, each one's row digest
    (:func:`row_digest`) recorded under its name as it passes: the push's reference, made from the
    very tensors pushed, with no second pass over the state."""
    for name, t in stream:
        dt = (dtypes or {}).get(name)
        if dt is not None and t.is_floating_point() and t.dtype != dt:
            t = t.to(dt)
        if digests is not None and dt is not None and name not in digests:
            digests[name] = row_digest(t, dt)
        yield name, t


def state_digest(state: dict, dtypes: dict | None) -> dict[str, torch.Tensor]:
    """Row digests (:func:`row_digest`) of ``state``'s tensors named in
    ``dtypes``, each in its engine dtype; aliases (tied weights) digested once.

    ``state`` may compute its tensors as they are read (a LoRA policy's merged weights): such a tensor
    is freed before the next is made, which may then get its address, so an alias is one whose first
    tensor is still alive (a weak reference), not merely one at the same address."""
    import weakref

    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}
    for n, dt in (dtypes or {}).items():
        t = state[n]
        key = (t.data_ptr(), tuple(t.shape), dt)
        if key not in seen or seen[key][0]() is None:
            seen[key] = (weakref.ref(t), row_digest(t, dt))
        out[n] = seen[key][1]
    return out


def transposed_names(model: torch.nn.Module) -> dict[str, tuple]:
    """``{state name: shape}`` of the weights of transformers' ``Conv1D`` modules (GPT-2), stored
    ``[in, out]``: an engine's linear layers hold their transpose. Own names (a LoRA-wrapped module's
    ``base_layer`` left out); shapes are the full tensors' (a sharded one's too)."""
    return {
        f"{n}.weight".replace(".base_layer.", "."): tuple(m.weight.shape)
        for n, m in model.named_modules()
        if type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None
    }


def tied_names(state: dict) -> set[str]:
    """Names in ``state`` whose tensor is another name's (tied weights: ``lm_head.weight`` and the
    embedding); the engine holds such a tensor once."""
    first: dict[tuple, str] = {}
    tied = set()
    for n, t in state.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        key = (local.data_ptr(), tuple(t.shape))
        if local.numel() and key in first:
            tied.add(n)
        first.setdefault(key, n)
    return tied
