"""Generate from a training run, a converted (Orbax) or a release-format checkpoint, printing each row's text as
every compiled decode block finishes: what ``dsv41 sample`` and ``infer/generate.py`` run.

The flow: :func:`dsv41_jax.checkpoint.load.load_model` (model, Engram hasher, the tokenizer that goes with
them) -> the prompts tokenised after BOS (or taken as token ids) -> ``engine.sampling.Generator``: chunked
exact or CED prefill into the packed cache, then compiled decode blocks with Engram rows hashed on the device.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tokenizers import Tokenizer

from dsv41_jax.checkpoint.load import load_drafter
from dsv41_jax.compile_cache import CompileNotice
from dsv41_jax.config import ConfigError
from dsv41_jax.engine.mesh import load_for_serving
from dsv41_jax.engine.sampling import Generator, SamplingConfig, SpeculativeError, validate_prompts
from dsv41_jax.engine.speculative import verify_widths as speculative_widths
from dsv41_jax.engram_device import device_engram


def _print(line: str) -> None:
    print(line, flush=True)  # each block as it finishes, also through a pipe


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def parse_ids(text: str) -> list[int]:
    """One ``--ids`` argument: ``"0,17,42"`` -> ``[0, 17, 42]`` (argparse's one-line error otherwise)."""
    from dsv41_jax.cli_args import token_ids

    return token_ids(text)


IMAGE_PLACEHOLDER = "<image>"  # in a text prompt: where an image goes (the tokenizer's own spelling works too)


def encode_prompts(tok: Tokenizer, bos_token_id: int, texts: Sequence[str], image_token_id: int | None = None
                   ) -> list[list[int]]:
    """Each text as BOS followed by its tokens (no other special tokens), as training saw documents; with
    ``image_token_id``, each ``<image>`` becomes that token (expanded into the image's span later)."""
    out = []
    for t in texts:
        pieces = t.split(IMAGE_PLACEHOLDER) if image_token_id is not None else [t]
        ids = [bos_token_id]
        for k, piece in enumerate(pieces):
            if k:
                ids.append(image_token_id)
            ids += tok.encode(piece, add_special_tokens=False).ids if piece else []
        out.append(ids)
    return out


def sample(*, run: str | os.PathLike | None = None, ckpt: str | os.PathLike | None = None,
           hf_dir: str | os.PathLike | None = None, prompts: Sequence[str] | None = None,
           ids: Sequence[Sequence[int]] | None = None, max_new_tokens: int = 32, max_seq_len: int = 4096,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
           prefill_mode: str = "exact", prefill_chunk: int = 512, dtype: str = "bfloat16",
           show_ids: bool = False, mesh: str | None = None, speculative: int | None = None,
           drafter: str | os.PathLike | None = None, sps: str | os.PathLike | None = None,
           verify_widths: Sequence[int] | None = None, images: Sequence[str] | None = None,
           log: Callable[[str], None] = _print, write: Callable[[str], None] | None = None) -> list[list[int]]:
    """Sample continuations of text ``prompts`` (or token-id prompts ``ids``) from one checkpoint source.

    One text prompt streams on one line: the prompt, then each block's new text as it is decoded (``write``,
    stdout by default). Several rows log each block's new text as ``[row] text``. With ``show_ids`` each row's
    generated ids follow as ``[row] ids a,b,c``. The compile of the first blocks is announced on stderr with its
    duration. Rows stop at the model's EOS or after ``max_new_tokens``. Returns the generated ids.
    ``mesh`` (``--mesh``): the weights sharded by the sharding table, sequences split over data × expert.
    ``speculative`` (``--speculative dspark[:K]``): speculative decoding with the checkpoint's DSpark drafter,
    ``K`` drafts per step (0: its block size), or with ``run`` the drafter its post-training kept in step; the
    acceptance counts are logged at the end. ``drafter``: a
    ``drafter.npz`` that DSpark training wrote (``dsv41 train`` of a ``dspark_train`` config) instead. ``sps``:
    the steps-per-second table of ``dsv41 profile-sps``: confidence-scheduled verify lengths, at the verify
    widths the table was measured at. ``verify_widths`` (``--verify-widths``): the verify chunk's compiled widths
    (rows per request, the widest ``K + 1``); with ``sps`` they must be the table's.
    ``images`` (``--image``, paths or data: URLs): one per ``<image>`` of the prompts, in order; each becomes
    its span through the checkpoint's vision tower (spec model §7).
    """
    if (verify_widths or sps is not None) and speculative is None:
        raise ConfigError(f"{'--verify-widths' if verify_widths else '--sps'} needs --speculative")
    loaded, on = load_for_serving(mesh, run=run, ckpt=ckpt, hf_dir=hf_dir, dtype=dtype, log=log)
    if loaded.step is not None:
        log(f"sampling from {run} step {loaded.step}")
    cfg = loaded.model.cfg
    tok = Tokenizer.from_file(str(loaded.tokenizer))
    batch = [list(p) for p in ids] if ids else encode_prompts(tok, cfg.bos_token_id, prompts or [],
                                                              cfg.image_token_id if images else None)
    vision = None
    if images:
        if run is not None and not hasattr(loaded.model, "vision"):
            raise ConfigError(f"--image: the run {run} has no vision tower (an image–text run has a vision: section "
                              "in its config); or give a checkpoint with --ckpt / --hf-dir")
        vision, batch = _image_prompts(batch, images, cfg, ckpt=ckpt, hf_dir=hf_dir, dtype=dtype,
                                       model=loaded.model if run is not None else None)
    draft_model, widths, table = None, tuple(verify_widths or ()), ()
    if speculative is not None:
        draft_model = _drafter(cfg, run=run, ckpt=ckpt, hf_dir=hf_dir, drafter=drafter)
        speculative = speculative or cfg.dspark.block_size
        if sps is not None:
            table, widths = _sps_table(sps, speculative, widths, len(batch))
        try:
            widths = speculative_widths(speculative, bool(table), widths)
        except ValueError as err:
            raise ConfigError(f"--verify-widths: {err}") from None
    try:  # before anything compiles: a prompt that cannot be generated from is the user's one-line error
        validate_prompts(batch, len(batch), cfg.vocab_size, max_seq_len)
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens,
                                  stop_tokens=(cfg.eos_token_id,), prefill_mode=prefill_mode,
                                  prefill_chunk=prefill_chunk, speculative=speculative or 0, sps=table,
                                  verify_widths=widths)
        gen = Generator(loaded.model, device_engram(loaded.hasher), len(batch), max_seq_len, sampling, mesh=on,
                        drafter=draft_model)
    except ValueError as err:
        flag = "--speculative" if isinstance(err, SpeculativeError) else "--ids" if ids else "--prompt"
        raise ConfigError(f"{flag}: {err}") from None

    stream = len(batch) == 1 and not ids and not images  # one text prompt: its text, then the continuation
    note = CompileNotice(f"prefill and decode ({len(batch)} row{'s' * (len(batch) > 1)}, {max_new_tokens} new tokens)")
    out = (write or _write) if stream else None

    def start():  # the compile line first, then the text: a terminal shows stderr and stdout together
        note.done()
        if out is not None:
            out(prompts[0])

    text = TextStream(tok, len(batch), write=out, log=log, start=start)
    outs = gen.generate(batch, seed=seed, on_block=text, images=vision)
    text.finish()
    if show_ids:
        for i, row in enumerate(outs):
            log(f"[{i}] ids {','.join(map(str, row))}")
    if speculative:
        log(acceptance_report(gen.stats))
    return outs


class TextStream:
    """Each row's new text as decode blocks arrive, shown without splitting a character.

    A byte-level tokenizer spreads one character over several tokens, which may fall in different blocks: each
    block decodes the row's whole generation so far and shows what follows the text already shown, holding back a
    trailing incomplete character (decoded as U+FFFD) until its bytes arrive. :meth:`finish` shows what is still
    held back, as the tokenizer decodes it (a generation may end mid-character). With ``write`` (one streamed row)
    the text goes there as it is; otherwise each row's non-blank delta is logged as ``[row] text``. ``start`` runs
    once, before the first block is shown.
    """

    def __init__(self, tok: Tokenizer, rows: int, *, write: Callable[[str], None] | None = None,
                 log: Callable[[str], None] = _print, start: Callable[[], None] | None = None):
        self.tok, self.write, self.log, self.start = tok, write, log, start
        self.ids: list[list[int]] = [[] for _ in range(rows)]
        self.shown = [""] * rows

    def __call__(self, block: Sequence[Sequence[int]], final: bool = False) -> None:
        """``block``: [rows, n] new ids, −1 once a row has stopped."""
        if self.start is not None:  # once, before anything is shown
            self.start, start = None, self.start
            start()
        for i, row in enumerate(block):
            self.ids[i] += [int(t) for t in row if t >= 0]
            text = self.tok.decode(self.ids[i], skip_special_tokens=False)
            if not final:
                text = text.rstrip("\ufffd")  # a character whose bytes are not all there yet: held back
                if not text.startswith(self.shown[i]):
                    continue
            delta = text[len(self.shown[i]):] if text.startswith(self.shown[i]) else ""
            if self.write is None and not delta.strip() and not final:
                continue  # a log line of blanks alone: they go with the next text
            self.shown[i] = text
            if self.write is not None:
                self.write(delta)
            elif delta.strip():
                self.log(f"[{i}] {delta}")

    def finish(self) -> None:
        """Show what each row still holds back; a streamed row ends its line."""
        self([[] for _ in self.ids], final=True)
        if self.write is not None:
            self.write("\n")


def _drafter(cfg, *, run, ckpt, hf_dir, drafter):
    """The DSpark drafter of ``--speculative``: a ``--drafter`` npz, a post-training run's own, or the checkpoint's
    ``mtp.*`` stages."""
    if drafter is not None:
        from dsv41_jax.train.dspark import load_drafter_npz

        try:
            return load_drafter_npz(drafter, cfg)
        except (OSError, ValueError) as err:
            raise ConfigError(f"--drafter {drafter}: {err}") from None
    if run is not None:
        from dsv41_jax.posttrain.drafter import run_drafter

        kept = run_drafter(run, cfg)  # a post-training run's drafter kept in step, if it has one
        if kept is None:
            raise ConfigError("--speculative: this training run holds no DSpark drafter; give --drafter "
                              "DRAFTER.npz (DSpark training's output) or sample from --ckpt / --hf-dir")
        return kept
    return load_drafter(cfg, ckpt=ckpt, hf_dir=hf_dir)


def _sps_table(path, k: int, widths: tuple[int, ...], batch: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """``(sps, widths)`` of a ``dsv41 profile-sps`` table: the verify widths are the ones it was measured at, so a
    scheduled step costs what the table says. A ConfigError names a table for another K, other widths or another
    batch (its rates and its token counts, ``sps[n]`` for n tokens over ``batch`` requests, are the batch's)."""
    import json

    try:
        raw = json.loads(Path(path).read_text())
        table, measured = tuple(float(x) for x in raw["sps"]), tuple(int(w) for w in raw["widths"])
        if not table or not measured or list(measured) != sorted(set(measured)):
            raise ValueError(f"widths {list(measured)} must be ascending and the table non-empty")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"--sps {path}: not a table written by dsv41 profile-sps ({err})") from None
    if raw.get("batch", batch) != batch:
        raise ConfigError(f"--sps {path}: measured at batch {raw['batch']}, but {batch} prompts are sampled; profile "
                          f"with dsv41 profile-sps --batch {batch}")
    if measured[-1] != k + 1:
        raise ConfigError(f"--sps {path}: measured up to {measured[-1] - 1} drafts per step, but --speculative "
                          f"verifies {k}; profile with dsv41 profile-sps --drafts {k}")
    if widths and tuple(sorted(set(widths))) != measured:
        raise ConfigError(f"--verify-widths {','.join(map(str, widths))}: the --sps table {path} was measured at "
                          f"widths {','.join(map(str, measured))}; profile again with those --verify-widths")
    return table, measured


def acceptance_report(stats: dict) -> str:
    """One line per sequence and the total: verify steps, drafts accepted of drafted, tokens per step, and the
    verify chunks' mean width (rows per request)."""
    steps, drafted, accepted, rows = (stats[k] for k in ("steps", "drafted", "accepted", "rows"))
    rows = [f"[{i}] {s} steps, {a}/{d} drafts accepted, {(a + s) / max(s, 1):.2f} tokens/step"
            for i, (s, d, a) in enumerate(zip(steps, drafted, accepted, strict=True))]
    total = (f"speculative: {steps.sum()} steps, {accepted.sum()}/{drafted.sum()} drafts accepted "
             f"({accepted.sum() / max(drafted.sum(), 1):.1%}), mean accepted length "
             f"{(accepted.sum() + steps.sum()) / max(steps.sum(), 1):.2f} tokens/step, verify chunks of "
             f"{rows.sum() / max(steps.sum(), 1):.2f} rows")
    return "\n".join([*rows, total])


def _image_prompts(batch: list[list[int]], images: Sequence[str], cfg, *, ckpt, hf_dir, dtype, model=None):
    """(PromptInputs, expanded prompts): the images through the vision tower (the checkpoint's, or ``model``'s
    own: an image–text run), each placeholder its span."""
    from dsv41_jax.checkpoint.load import vision_encoder
    from dsv41_jax.vision.processor import process_image
    from dsv41_jax.vision.prompt import ImageEncoder

    try:
        processed = [process_image(path, cfg.vision) for path in images]
    except (OSError, ValueError) as err:
        raise ConfigError(f"--image: {err}") from None
    encoder = ImageEncoder(model if model is not None else vision_encoder(ckpt=ckpt, hf_dir=hf_dir, dtype=dtype))
    try:
        inputs = encoder.prompt_inputs(batch, processed, cfg.image_token_id, pad_id=cfg.pad_token_id)
    except ValueError as err:
        raise ConfigError(f"--image: {err} (write {IMAGE_PLACEHOLDER} in --prompt where each image goes)") from None
    return inputs, [list(inputs.ids[b, : inputs.lengths[b]]) for b in range(len(batch))]
