"""`bench time` (side-by-side step time) and `bench fit` (the ladder search, with a stand-in compiler)."""

import json

from metatrain import cli, fit


def test_bench_time_rows(tmp_path, capsys):
    out = tmp_path / "time.json"
    assert cli.main(["bench", "time", "--model", "tiny", "--seq-len", "16", "--batch", "2", "--rounds", "3",
                     "--json", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"default+remat", "mixflow+remat+save"}
    assert rows["default+remat"]["ratio"] == 1.0 and len(rows["mixflow+remat+save"]["times_s"]) == 3
    r = rows["mixflow+remat+save"]
    assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"] and r["median_s"] > 0
    assert "| mixflow+remat+save |" in capsys.readouterr().out


def test_bench_fit_binary_search(monkeypatch, capsys):
    """A stand-in compiler where memory grows with the preset's size: the search must find the boundary."""
    import models

    limits = {"default": 300e6, "mixflow": 2.1e9}  # parameters that fit, per mode
    compiled = []

    def fake_compile(cfg, model, topology):
        n = models.param_count(model)
        compiled.append(n)
        fits = n <= limits[cfg.mode]
        need = n * 100.0
        return {"fits": fits, "hbm_bytes": 95.74 * 2**30, **({"total_bytes": need} if fits else
                                                            {"required_bytes": need})}

    monkeypatch.setattr(fit, "compile_outer_step", fake_compile)
    assert cli.main(["bench", "fit", "--topology", "v5p:1x1x1"]) == 0
    out = capsys.readouterr().out
    assert "largest that fits, default+remat: 278m" in out
    assert "largest that fits, mixflow+remat+save: 2b" in out
    ratio = models.param_count(models.preset("2b")) / models.param_count(models.preset("278m"))
    assert f"ratio of parameter counts (mixflow+remat+save / default+remat): {ratio:.2f}x" in out
    assert len(compiled) <= 2 * 6  # a binary search over 22 presets, not a sweep


def test_bench_fit_variant_model_options(monkeypatch, capsys, tmp_path):
    """`+sqrt+blockwise+bf16` reach the compiled program: the stand-in fits more only with all three."""
    import models

    seen = []

    def fake_compile(cfg, model, topology):
        seen.append((cfg.mode, cfg.inner_checkpoint, model.attention, model.compute_dtype, model.remat))
        full = (cfg.inner_checkpoint, model.attention, model.compute_dtype) == ("sqrt", "blockwise", "bfloat16")
        fits = models.param_count(model) <= (4e9 if full else 300e6)
        return {"fits": fits, "hbm_bytes": 1.0, **({"total_bytes": 1.0} if fits else {"required_bytes": 2.0})}

    monkeypatch.setattr(fit, "compile_outer_step", fake_compile)
    out = tmp_path / "fit.json"
    assert cli.main(["bench", "fit", "--topology", "v5p:1x1x1", "--json", str(out), "--variants",
                     "default+remat,mixflow+remat+save,mixflow+remat+save+sqrt+blockwise+bf16"]) == 0
    text = capsys.readouterr().out
    assert "largest that fits, mixflow+remat+save: 278m" in text
    assert "largest that fits, mixflow+remat+save+sqrt+blockwise+bf16: 3.8b" in text
    assert "(mixflow+remat+save+sqrt+blockwise+bf16 / default+remat)" in text
    assert ("mixflow", "sqrt", "blockwise", "bfloat16", True) in seen
    assert ("default", "every_step", "dense", "", True) in seen
    assert [r["largest"] for r in json.loads(out.read_text())["results"]] == ["278m", "278m", "3.8b"]


def test_parse_variant_names_round_trip():
    import pytest

    import models
    from metatrain.problem import parse_variant

    for name in ("default", "mixflow+remat+save", "mixflow+remat+save+sqrt+blockwise+bf16", "revfwd+binomial"):
        assert parse_variant(name).name == name
    v = parse_variant("mixflow+bf16+blockwise+remat")  # any order; the name comes out canonical
    assert v.name == "mixflow+remat+blockwise+bf16" and v.model_options == ("blockwise", "bf16")
    tiny = models.preset("tiny")
    m = v.model(tiny)
    assert (m.attention, m.compute_dtype, m.remat) == ("blockwise", "bfloat16", True) and not tiny.remat
    for bad, says in (("mixflo+remat", "unknown mode"), ("mixflow+flash", "unknown option"),
                      ("mixflow+sqrt+binomial", "one inner-checkpoint schedule")):
        with pytest.raises(ValueError, match=says):
            parse_variant(bad)
