"""eval_report's automation condition, evaluated tick by tick by Dagster's own evaluator on a real
instance: every deepswe_eval materialization is followed by a refresh, including one that lands in
the same sensor interval as the previous refresh's request or materialization (the race that made
the daemon skip the report after a second backfill of one partition)."""

import dagster as dg

from assets.partitions import checkpoints_partitions
from dagster_project.definitions import defs

REPORT = dg.AssetSelection.assets("eval_report")
KEY = "r1-step_000004"


class Ticks:
    """The automation sensor's ticks, one :meth:`tick` per evaluation, carrying the cursor."""

    def __init__(self, instance):
        self.instance, self.cursor = instance, None

    def tick(self) -> int:
        result = dg.evaluate_automation_conditions(defs=defs, instance=self.instance, asset_selection=REPORT,
                                                   cursor=self.cursor)
        self.cursor = result.cursor
        return result.total_requested

    def eval_done(self, key: str = KEY) -> None:
        self.instance.report_runless_asset_event(dg.AssetMaterialization("deepswe_eval", partition=key))

    def report_done(self) -> None:
        self.instance.report_runless_asset_event(dg.AssetMaterialization("eval_report"))


def ticks(instance) -> Ticks:
    instance.add_dynamic_partitions(checkpoints_partitions.name, ["r1-step_000000", KEY])
    t = Ticks(instance)
    assert t.tick() == 0  # nothing evaluated yet
    return t


def test_an_eval_in_the_same_interval_as_the_refresh_is_not_dropped(posttrain_home):
    with dg.instance_for_test() as instance:
        t = ticks(instance)
        t.eval_done()
        assert t.tick() == 1
        # the requested report run materializes and the second eval of the same partition lands,
        # both before the sensor's next tick
        t.report_done()
        t.eval_done()
        assert t.tick() == 1
        t.report_done()
        assert t.tick() == 0  # handled; nothing new since
        assert t.tick() == 0


def test_an_eval_that_lands_after_the_request_asks_again(posttrain_home):
    with dg.instance_for_test() as instance:
        t = ticks(instance)
        t.eval_done()
        assert t.tick() == 1
        # the report run requested on that tick may already have read the rows: an eval landing
        # after the request means one more refresh
        t.eval_done("r1-step_000000")
        assert t.tick() == 1
        t.report_done()
        t.report_done()
        assert t.tick() == 0


def test_evals_between_two_ticks_make_one_refresh(posttrain_home):
    with dg.instance_for_test() as instance:
        t = ticks(instance)
        t.eval_done("r1-step_000000")
        t.eval_done()
        t.eval_done()
        assert t.tick() == 1
        t.report_done()
        assert t.tick() == 0
        # a report materialized by hand is no eval: it asks for nothing
        t.report_done()
        assert t.tick() == 0
