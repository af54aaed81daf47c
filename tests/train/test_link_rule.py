"""A link rule of one's own: a class with the :class:`~aqsgd.train.adaptive.LinkRule` methods, given to the
trainer, chooses the codecs of ``auto`` links; nothing of the trainer changes. The rule here sends every link
at the floor of its ladder from the first step on, and says what it saw."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aqsgd.comm.testing import run_processes
from aqsgd.train.adaptive import AutoSpec, LinkRule, StepSample, link_name
from aqsgd.train.config import TrainConfig
from aqsgd.train.trainer import Trainer


class FloorRule:
    """Every auto link at the most compressed rung of its ladder, chosen after the first step."""

    def __init__(self, boundaries: int, forward: AutoSpec | None, backward: AutoSpec | None) -> None:
        self.autos = {link_name(b, a.direction): a
                      for b in range(boundaries) for a in (forward, backward) if a is not None}
        self.levels = dict.fromkeys(self.autos, 0)
        self.seen: list[float] = []  # each step's codec bytes over all links, as the samples carried them

    def specs(self) -> dict[str, str]:
        return {name: auto.spec(self.levels[name]) for name, auto in self.autos.items()}

    def step(self, sample: StepSample, micro_batches: int, *, fills: int = 1) -> dict[str, str]:
        self.seen.append(sum(link.sent for link in sample.links.values()))
        changes = {}
        for name, auto in self.autos.items():
            if self.levels[name] != len(auto.ladder) - 1:
                self.levels[name] = len(auto.ladder) - 1
                changes[name] = auto.spec(self.levels[name])
        return changes

    def probes(self) -> dict[str, tuple[str, ...]]:
        return {}

    def probes_at(self, step: int) -> bool:
        return False

    def restore(self, levels: Mapping[str, str | int]) -> None:
        for name, spec in levels.items():
            auto = self.autos[name]
            self.levels[name] = auto.ladder.index(str(spec).split(":", 1)[1])

    def state(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.seen = list(state["seen"])

    def describe(self) -> dict[str, Any]:
        return {name: {"spec": spec, "steps": len(self.seen)} for name, spec in self.specs().items()}

    def overview(self) -> dict[str, Any]:
        return {"rule": "floor", "bytes_seen": self.seen[-1] if self.seen else None}


def test_the_floor_rule_is_a_link_rule():
    rule: LinkRule = FloorRule(1, None, None)  # as a type checker sees it
    assert rule.specs() == {} and rule.step(StepSample({}, 0.0, 0.0), 1) == {}


def _worker(rank: int, world: int, cfg_json: str) -> dict[str, Any] | None:
    trainer = Trainer(TrainConfig.from_dict(json.loads(cfg_json)), link_rule=FloorRule)
    summary = trainer.run()
    return summary if trainer.writes_metrics else None


def test_a_rule_of_one_s_own_chooses_the_links_codecs(tmp_path: Path):
    cfg = TrainConfig.of(
        task="synthetic-lm", model_layers=2, hidden_size=32, vocab_size=64, max_length=16,
        max_train_samples=8, max_eval_samples=4, stages=2, micro_batches=2, micro_batch_size=2,
        forward="auto", backward="auto", warmup_epochs=0, epochs=1, max_steps=2, runtime="distributed",
        timeout=60.0, eval_every=0, checkpoint_every=0, output_dir=str(tmp_path), run_name="floor",
        progress=False, tensorboard=False, cache_dir=str(tmp_path / "cache"))
    summary = next(r for r in run_processes(_worker, 2, args=(cfg.to_json(),), timeout_s=180) if r)
    rows = [json.loads(line) for line in (tmp_path / "floor" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    # step 1 sent the ladders' tops; the rule then put both links at their floors for step 2
    assert train[0]["codecs"] == {"b0.forward": "delta:fp16", "b0.backward": "direct:bf16"}
    assert train[1]["codecs"] == {"b0.forward": "delta:q2:l2", "b0.backward": "direct:q4"}
    assert train[1]["link_bits"] == {"b0.forward": 2.0, "b0.backward": 4.0}
    # ... and what it was fed is what the metrics counted: the codec bytes of every link
    assert train[1]["link_policy"] == {"rule": "floor", "bytes_seen": float(train[1]["bytes_sent"])}
    assert train[1]["bytes_sent"] < train[0]["bytes_sent"] / 4
    assert summary["links"] == {"b0.forward": {"spec": "delta:q2:l2", "steps": 2},
                                "b0.backward": {"spec": "direct:q4", "steps": 2}}
    assert "link_errors" in train[1] and train[1]["link_errors"] == {}  # it probes nothing
