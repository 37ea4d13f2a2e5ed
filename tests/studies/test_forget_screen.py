"""The forgetting-by-content screen (`experiments.forget_screen`): a retrofit starts from the recipe's
checkpoint, keeps its own settings, scores every cell, resumes, and the table judges each row."""

from __future__ import annotations

import json

import pytest

from experiments import forget_screen as F
from experiments import one_recipe as O
from experiments.recipes import PRETRAIN, SCREEN

TINY = [
  "--layers", "2", "--d-model", "16", "--heads", "2", "--block-size", "32", "--batch-size", "8", "--warmup", "1",
  "--train-len", "288", "--passkey-rows", "4", "--small-data",
]  # fmt: skip


def test_nowalk_rows_hold_the_upper_layer_only():
  args = F.parse_args(TINY)
  cfg = F.config("nowalk_hinge", args, 0)
  assert cfg.head_gates == "pp,nn" and cfg.evict_weight == 1.0 and cfg.evict_ramp_start == args.source_step
  assert cfg.steps == args.source_step + args.retrofit_steps and cfg.lr == 5e-4 and cfg.gate_lr_scale == 1.0
  ctl = F.config("control", args, 0)  # the paired control: the same run settings, no mechanism
  assert ctl.head_gates == "" and ctl.evict_weight == 0.0 and ctl.lr == cfg.lr and ctl.seed == cfg.seed == 0
  assert set(SCREEN) >= {"control", "nowalk_hinge", "hinge", "nowalk"}
  top = F.config("nowalk_hinge_top", args, 0)
  assert top.objective_layers == "1" and top.objective_layer_ids == (1,) and top.head_gates == "pp,nn"
  assert cfg.objective_layers == "" and cfg.objective_layer_ids is None


def test_quiet_rows_take_the_walk_from_heads_that_forget_nothing(tmp_path):
  """`nowalk_quiet`: "n" only on the upper heads whose median penalty on the source is under
  QUIET_NATS (read from the seed's kept heads file), the lower layer untouched."""
  stats = [
    {"layer": 0, "head": 0, "median_penalty": 0.0},
    {"layer": 0, "head": 1, "median_penalty": 0.0},
    {"layer": 1, "head": 1, "median_penalty": 0.3},
    {"layer": 1, "head": 0, "median_penalty": 80.0},
  ]
  assert F.quiet_letters(stats) == "pn" and F.quiet_letters(stats, nats=0.1) == "pp"
  args = F.parse_args(TINY + ["--out-dir", str(tmp_path)])
  src = F.source_checkpoint(args, 0)
  (tmp_path / "heads").mkdir()
  rec = {"source": str(src), "quiet_nats": F.QUIET_NATS, "upper": F.quiet_letters(stats), "needle": stats}
  (tmp_path / "heads" / "s0.json").write_text(json.dumps(rec))
  cfg = F.config("quiet_hinge_top", args, 0)
  assert cfg.head_gates == "pp,pn" and cfg.objective_layers == "1" and cfg.evict_weight == 1.0
  # a file from before the digest, matched by its path, gains the source's digest (not measured again)
  kept = json.loads((tmp_path / "heads" / "s0.json").read_text())
  assert kept["upper"] == "pn" and len(kept["source_params"]) == 16
  kept["source"] = "elsewhere"  # the same parameters found at another path: still this file's
  (tmp_path / "heads" / "s0.json").write_text(json.dumps(kept))
  assert F.config("quiet_hinge_top", args, 0).head_gates == "pp,pn"
  # a longer retrofit is read against the control continued as long
  long = F.config("quiet_hinge_top_1200", args, 0)
  assert long.steps == args.source_step + 1200 == F.config("control_1200", args, 0).steps
  assert F.control_of("quiet_hinge_top_1200") == "control_1200" and F.control_of("quiet_hinge_top") == "control"
  assert cfg.steps == args.source_step + args.retrofit_steps
  tau = F.config("quiet_hinge_top_tau120", args, 0)  # the hinge at the tolerance bound's scale
  assert (tau.evict_tau, tau.evict_temp, tau.head_gates) == (120.0, 30.0, "pp,pn")


def test_retrieval_rows_take_the_walk_from_the_quiet_heads_that_read_the_needle_most(tmp_path):
  """`nowalk_retrieval: n`: of each upper layer's quiet heads, only the n with the largest needle mass
  lose their walk; a head that forgets by age keeps it however much it reads the needle."""
  stats = [{"layer": 0, "head": h, "median_penalty": 90.0, "needle_mass": 0.5} for h in range(4)] + [
    {"layer": 1, "head": h, "median_penalty": m, "needle_mass": a}
    for h, (m, a) in enumerate([(80.0, 0.9), (0.1, 0.02), (0.5, 0.04), (0.2, 0.03)])
  ]
  assert F.quiet_letters(stats) == "pnnn"
  assert F.quiet_letters(stats, most=2) == "ppnn" and F.quiet_letters(stats, most=1) == "ppnp"
  assert F.quiet_letters(stats, most=9) == "pnnn"  # more than there are quiet heads: all of them
  args = F.parse_args(TINY + ["--out-dir", str(tmp_path)])
  src = F.source_checkpoint(args, 0)
  two = [  # the tiny source's 2 heads a layer: upper h0 forgets by age, h1 is quiet
    {"layer": i, "head": h, "median_penalty": m, "needle_mass": 0.1}
    for i, ms in enumerate([(90.0, 90.0), (80.0, 0.5)])
    for h, m in enumerate(ms)
  ]
  (tmp_path / "heads").mkdir()
  rec = {"source": str(src), "quiet_nats": F.QUIET_NATS, "upper": F.quiet_letters(two), "needle": two}
  (tmp_path / "heads" / "s0.json").write_text(json.dumps(rec))
  cfg = F.config("retrieval2_shared_distill_t25", args, 0)
  assert cfg.head_gates == "pp,pn" and cfg.evict_shared and cfg.evict_target == 0.25 and cfg.distill_weight == 1.0


def test_deeper_screens_press_every_layer_above_the_first(monkeypatch):
  """At 4 layers "the upper layers" are layers 1-3: the walk goes from all of them (or from their quiet
  heads, per layer), the objectives press all of them; a source checkpoint of another depth is passed
  over with an error that says which to train."""
  args = F.parse_args(TINY[2:] + ["--layers", "4", "--source-dir", "/nonexistent"])
  with pytest.raises(SystemExit, match="4 layers.*has 2.*--layers 4"):
    F.source_checkpoint(args, 1)  # only the committed copy at the recipe's 2 layers
  assert F.source_checkpoint(args, 0).is_relative_to(F.ASSETS_L4)  # the 4-layer one, not seed 0's 2-layer
  stats = [
    {"layer": i, "head": h, "median_penalty": m, "needle_penalty": 0.0}
    for i, ms in enumerate([(9.0, 9.0), (0.0, 50.0), (0.2, 0.1), (30.0, 0.0)])
    for h, m in enumerate(ms)
  ]
  assert F.quiet_letters(stats) == "np,nn,pn"
  assert F.needle_words(stats).startswith("l1: h0 0.0/0.0 h1 0.0/50.0; l2: h0 0.0/0.2")
  assert F.needle_words([r for r in stats if r["layer"] < 2]) == "h0 0.0/0.0 h1 0.0/50.0"  # 2 layers: as before
  split = {
    "heads": [
      {"layer": i, "head": h, "held": 0.1 * (i + h), "copy_held": float(i == 1)} for i in (0, 1) for h in (0, 1)
    ]
  }
  assert F.split_words(split) == "h0 0.10/1.0 h1 0.20/1.0 (l0 0.05)" and F.split_words(None) == "—"
  cfg = F.config("nowalk_hinge_top", args, 0)
  assert cfg.head_gates == "pp,nn,nn,nn" and cfg.objective_layers == "1,2,3" and cfg.objective_layer_ids == (1, 2, 3)
  monkeypatch.setattr(F, "quiet_heads", lambda a, s, most=None: "np,nn,pn")  # the source's measured letters
  assert F.config("quiet_hinge_top", args, 0).head_gates == "pp,np,nn,pn"
  monkeypatch.setattr(F, "quiet_heads", lambda a, s, most=None: "pn")  # a heads file of the 2-layer screen
  with pytest.raises(SystemExit, match="names heads for 2 layers, the model has 4"):
    F.config("quiet_hinge_top", args, 0)


def test_a_row_may_train_at_its_own_shape():
  """`train` overrides the rows' shape for training only (DMS's longer rows); the source's data position,
  for the recipe's shape, is not restored into the row's stream, the row's own is."""
  args = F.parse_args(TINY)
  cfg = F.config("distill_long", args, 0)
  shape = SCREEN["distill_long"]["train"]
  assert (cfg.seq_len, cfg.batch_size) == (shape["train_len"], shape["batch_size"]) != (args.train_len, args.batch_size)
  assert cfg.head_gates == "" and cfg.distill_weight == 1.0 and cfg.objective_layers == "1"
  assert F.config("control", args, 0).seq_len == args.train_len  # the other rows: the recipe's shape

  class Data:
    def __init__(self, seq_len):
      self.state = {"passkey_count": 0, "text": {"iterator": {"next_index": 0}, "info": {"seq_len": seq_len}}}

    def get_state(self):
      return self.state

    def set_state(self, state):
      self.state = state

  logs = []
  data = F._NewShape(Data(2048), logs.append)
  data.set_state(Data(512).state | {"passkey_count": 9})  # the source's: another shape, not restored
  assert data.get_state()["passkey_count"] == 0 and "starts afresh" in logs[0]
  own = Data(2048).state | {"passkey_count": 7}  # the row's own checkpoint: restored
  data.set_state(own)
  assert data.get_state() == own and len(logs) == 1


def test_verdict_reads_the_targets():
  cell = lambda a: {"accuracy": a}
  row = {
    "cache": {"fpa_budget/0.25": cell(1.0), "fpa_global/0.125": cell(0.96), "fpa_budget/0.125": cell(0.2)},
    "passkey_full": cell(1.0),
    "text": {"bpb": 2.010},
  }
  ctl, fox = {"text": {"bpb": 2.0}}, ("fpa_global", 0.6)
  # nothing holds that was not compared: the heuristics, FoX, the tolerance policy and the control
  missing = ["heuristics not scored", "FoX not scored", "tolerance not scored", "text not scored"]
  assert F.verdict(row, None) == ("not scored", missing)
  row["cache"] |= {"fpa/tol": {"accuracy": 1.0, "kept_fraction_mean": 0.2}, "window/0.125": cell(0.2)}
  assert F.verdict(row, ctl, fox) == ("holds", [])
  assert F.verdict(row, {"text": {"bpb": 1.99}}, fox) == ("fails", ["text"])  # +1.0% against the control
  assert F.verdict(row, ctl, ("fpa_global", 0.9)) == ("fails", ["FoX"])
  # the tolerance policy: a bound that must also keep <= 25% of the keys on average
  row["cache"]["fpa/tol"]["kept_fraction_mean"] = 0.9
  assert F.verdict(row, ctl, fox) == ("fails", ["tolerance"])
  row["cache"]["fpa/tol"]["kept_fraction_mean"] = 0.2
  assert F.layer_words(row["cache"]["fpa/tol"]) == ""  # a cell from before the per-layer share
  assert F.layer_words({"kept_fraction_per_layer": [0.301, 0.76]}) == " (0.30 / 0.76)"
  # heuristics scored at 12.5%: the learned rule must lead the best of them by >= 0.1
  row["cache"] |= {"snapkv/0.125": cell(0.87)}
  assert F.best_heuristic(row, "0.125") == ("snapkv", 0.87) and F.best_heuristic(row, "0.25") is None
  assert F.verdict(row, ctl, fox) == ("fails", ["heuristics"])
  row["cache"]["snapkv/0.125"] = cell(0.86)
  assert F.verdict(row, ctl, fox) == ("holds", [])
  row["cache"]["fpa_global/0.125"] = cell(0.94)
  assert F.verdict(row, None) == ("fails", ["12.5%", "heuristics"])  # a failure fails whatever is missing


def test_oracle_split_gives_the_budget_by_hand(monkeypatch):
  """Each upper head alone, then the upper layers, every other head streaming (+inf offset)."""
  import math

  from experiments import needle_penalty as N
  from fpa_jax import configs as C
  from fpa_jax import eval as ev
  from fpa_jax.models import build_model

  model = build_model(C.get_config("tiny", attention="fpa", n_layers=3, n_heads=2, n_kv_heads=2), seed=0)
  seen = []

  def cell(model, examples, *, policy, prefill, batch_size):
    seen.append(policy.head_offset)
    return {"accuracy": len(seen) / 10, "n": len(examples)}

  monkeypatch.setattr(ev, "passkey_cell", cell)
  got = N.oracle_split(model, [{}] * 3, 0.125)
  inf = math.inf
  assert seen == [
    (inf, inf, 0.0, inf, inf, inf), (inf, inf, inf, 0.0, inf, inf), (inf, inf, inf, inf, 0.0, inf),
    (inf, inf, inf, inf, inf, 0.0), (inf, inf, 0.0, 0.0, 0.0, 0.0),
  ]  # fmt: skip
  assert [(r["layer"], r["head"]) for r in got] == [(1, 0), (1, 1), (2, 0), (2, 1), (None, None)]
  assert got[-1] == {"layer": None, "head": None, "accuracy": 0.5, "n": 3}
  rows = {("leaky", 1): {"cache": {"fpa_global/0.125": {"accuracy": 0.4}}, "oracle": {"prompts": 3, "sets": got}}}
  table = F.oracle_table(rows, ["leaky"], [1])
  assert "| `leaky` | 1 | 0.40 | l1: h0 0.10 h1 0.20; l2: h0 0.30 h1 0.40 | 0.50 | 3 |" in table
  assert F.oracle_table({("leaky", 1): {}}, ["leaky"], [1]) == ""


@pytest.mark.slow
def test_tiny_screen_retrofits_scores_and_resumes(tmp_path):
  common = TINY + ["--data-dir", str(tmp_path / "data")]
  src = ["--methods", PRETRAIN, "--seeds", "0", "--steps", "2", "--stage-steps", "2", "--n-val", "5"]
  O.main(common + src + ["--phase", "train", "--runs-dir", str(tmp_path / "src"), "--out-dir", str(tmp_path / "o")])
  argv = common + [
    "--mechanisms", "control", "nowalk_hinge", "--source-step", "2", "--retrofit-steps", "2",
    "--source-dir", str(tmp_path / "src"), "--runs-dir", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "out"),
    "--n", "5", "--cache-multiple", "2", "--heldout-windows", "8", "--needle-prompts", "5",
  ]  # fmt: skip
  md = F.main(argv)
  row = json.loads((tmp_path / "out" / "eval" / "nowalk_hinge_s0.json").read_text())
  assert set(row["cache"]) == {"fpa/tol", "fpa_budget/0.25", "fpa_budget/0.125", "fpa_global/0.25", "fpa_global/0.125"}
  assert len(row["cache"]["fpa/tol"]["kept_fraction_per_layer"]) == 2  # which layer the bound keeps
  assert row["step"] == 4 and "bpb" in row["text"] and row["passkey_full"]["n"] == 5 and row["needle"]
  cfg = json.loads((tmp_path / "runs" / "nowalk_hinge_s0" / "config.json").read_text())
  assert cfg["head_gates"] == "pp,nn" and cfg["evict_weight"] == 1.0
  assert "`nowalk_hinge` | 0 |" in md and "`control` | 0 |" in md and "+0.00%" in md  # the control against itself
  before = (tmp_path / "out" / "eval" / "nowalk_hinge_s0.json").read_text()
  F.main(argv)  # all done: nothing retrained or rescored
  assert (tmp_path / "out" / "eval" / "nowalk_hinge_s0.json").read_text() == before
  md = F.main(argv + ["--heuristics", "window", "--oracle-prompts", "5"])  # asked later: only those are scored
  after = json.loads((tmp_path / "out" / "eval" / "nowalk_hinge_s0.json").read_text())
  assert set(after["cache"]) - set(row["cache"]) == {"window/0.125"} and after["text"] == row["text"]
  assert "(window) |" in md
  sets = after["oracle"]["sets"]  # each upper head alone (2 kv heads), then the upper layer
  assert [(r["layer"], r["head"]) for r in sets] == [(1, 0), (1, 1), (None, None)] and after["oracle"]["prompts"] == 5
  assert "the budget given by hand" in md and "`nowalk_hinge` | 0 |" in md.split("given by hand")[1]
  assert (tmp_path / "out" / "forget_screen.md").exists()


def test_committed_recipe_checkpoint_is_the_scored_one():
  """The recipe checkpoint a fresh clone retrofits from (experiments/assets/one_recipe) is the one the
  one-recipe study scored: the same parameters, bit for bit, as its eval file records; seeds 1-2 (retrained
  for the screen) are the ones the screen's heads files record."""
  from experiments import _common as U
  from fpa_jax.inference import load_model

  args = F.parse_args([])
  args.source_dir = "/nonexistent"  # only the committed copy
  src = F.source_checkpoint(args, 0)
  assert src.is_relative_to(F.ASSETS)
  model, _ = load_model(str(src.parent.parent))
  scored = json.loads((U.ROOT / "results" / "one_recipe" / "eval" / f"{PRETRAIN}_s0.json").read_text())
  assert U.params_digest(model) == scored["params"]
  for seed in (1, 2):  # retrained for the screen: the parameters its rows of that seed retrofitted
    src = F.source_checkpoint(args, seed)
    kept = json.loads((U.ROOT / "results" / "forget_screen" / "heads" / f"s{seed}.json").read_text())
    assert (
      src.is_relative_to(F.ASSETS) and U.params_digest(load_model(str(src.parent.parent))[0]) == kept["source_params"]
    )
  args.layers = 4  # the recipe at 4 layers: the parameters the deeper screen's rows retrofitted
  src = F.source_checkpoint(args, 0)
  kept = json.loads((U.ROOT / "results" / "forget_screen_l4" / "heads" / "s0.json").read_text())
  assert (
    src.is_relative_to(F.ASSETS_L4) and U.params_digest(load_model(str(src.parent.parent))[0]) == kept["source_params"]
  )


def test_claim_row_judges_every_target(tmp_path):
  ev = tmp_path / "results" / "forget_screen" / "eval"
  ev.mkdir(parents=True)
  cell = lambda a: {"accuracy": a}  # noqa: E731
  full = {"passkey_full": cell(1.0), "seed": 0}
  rows = {
    "control": {**full, "text": {"bpb": 2.0}, "cache": {"fpa_budget/0.25": cell(0.3)}},
    "nowalk_hinge": {**full, "text": {"bpb": 2.08}, "cache": {"fpa_budget/0.25": cell(1.0), "fpa_global/0.125": cell(1.0)}},
    "nowalk": {**full, "text": {"bpb": 2.005}, "cache": {"fpa_global/0.25": cell(1.0), "fpa_budget/0.125": cell(0.97),
               "fpa/tol": {"accuracy": 1.0, "kept_fraction_mean": 0.2}, "snapkv/0.125": cell(0.5)}},
  }  # fmt: skip
  for m, r in rows.items():
    (ev / f"{m}_s0.json").write_text(json.dumps({**r, "mechanism": m}))
  fox = tmp_path / "results" / "one_recipe" / "eval"
  fox.mkdir(parents=True)
  (row,) = F.claim_rows(tmp_path)
  assert row.verdict == "not met (0 of 2 mechanisms, seed 0)"  # every target but FoX's, unscored: not a hold
  (fox / "fox_s0.json").write_text(json.dumps({"cache": {"parallel/fpa_global/0.125": cell(0.8)}}))
  (row,) = F.claim_rows(tmp_path)
  assert row.verdict == "holds (`nowalk`)"  # +0.25% text, 1.00 / 0.97, 0.47 ahead: every target, all scored
  # each cell quotes one rule, named
  assert "`nowalk_hinge` seed 0: fpa_budget 1.00 / fpa_global 1.00, text +4.00%" in row.evidence
  assert "`nowalk` seed 0: fpa_global 1.00 / fpa_budget 0.97" in row.evidence and "control" not in row.evidence
  (ev / "nowalk_s0.json").unlink()
  (row,) = F.claim_rows(tmp_path)
  assert row.verdict == "not met (0 of 1 mechanisms, seed 0)" and not row.evidence.startswith("every cache")
  # every cache target on every seed is named once all of them were judged: the heuristics scored, and
  # FoX beside the recipe (same seed), whose best rule at 12.5% must trail the learned rule's by >= 0.1
  hinge = {**rows["nowalk_hinge"], "mechanism": "nowalk_hinge"}
  hinge["cache"] = {**hinge["cache"], "snapkv/0.125": cell(0.5)}
  (ev / "nowalk_hinge_s0.json").write_text(json.dumps(hinge))
  (fox / "fox_s0.json").write_text(json.dumps({"cache": {"parallel/fpa_global/0.125": cell(0.9), "x/0.25": cell(1.0)}}))
  assert F.fox_best(0, root=tmp_path) == ("fpa_global", 0.9) and F.fox_best(1, root=tmp_path) is None
  (row,) = F.claim_rows(tmp_path)
  assert row.evidence.startswith("every cache target") and "not: `nowalk_hinge` (1 of 1 seed)" in row.evidence
  (fox / "fox_s0.json").write_text(json.dumps({"cache": {"parallel/fpa_global/0.125": cell(0.95)}}))
  assert not F.claim_rows(tmp_path)[0].evidence.startswith("every cache target")  # 1.00 against FoX's 0.95
  (fox / "fox_s0.json").unlink()
  deep = tmp_path / "results" / "forget_screen_l4" / "eval"  # the same screen at 4 layers: its rows labelled
  deep.mkdir(parents=True)
  for m, r in rows.items():
    (deep / f"{m}_s0.json").write_text(json.dumps({**r, "mechanism": m}))
  (row,) = F.claim_rows(tmp_path)  # no FoX at 4 layers (nor now at 2) to lead: nothing holds
  assert row.verdict == "not met (0 of 3 mechanisms, seed 0)"
  assert "`nowalk_hinge` at 4 layers seed 0: fpa_budget 1.00 / fpa_global 1.00" in row.evidence


def test_docstring_commands_parse():
  """Every `python -m experiments.forget_screen ...` in the module's docstring is a valid command line."""
  doc = F.__doc__.replace("\\\n", " ")
  cmds = [ln.split("#")[0].split()[3:] for ln in doc.splitlines() if ln.strip().startswith("python -m " + F.MODULE)]
  assert len(cmds) >= 4
  for argv in cmds:
    F.parse_args(argv)
