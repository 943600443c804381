"""The scaling model's formulas against cases worked out by hand, and its fit on the smaller shapes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dptrain_bench.scaling_model import (NAMED_LINKS, Link, Measured, Plan, Workload, bytes_sent_per_rank, calibrate,
                                 collectives, comm_cpu_per_byte, curve, fit_overlap, memory_per_rank, named_link,
                                 node_counts, powersgd_elements, predict, split_for_fit)
from dptrain.errors import ConfigError

# 100 us a message, 100 MB/s; a model of 1 M float32 parameters (4 MB); 100 images a step at 1 ms each on one rank
LINK = Link("test", 1e-4, 1e8, "for the tests")
WORK = Workload(param_bytes=4e6, global_batch=100, compute_s_per_sample=1e-3, ranks_share_a_node=False)


def test_ddp_on_two_nodes_by_hand():
    # all-reduce of 4 MB on 2 ranks: 2(N-1) alpha + 2(N-1)/N S / B = 2e-4 + 0.04 s; compute 100 x 1 ms / 2 = 0.05 s
    [allreduce] = collectives(Plan(strategy="ddp"), WORK, 2)
    assert (allreduce.kind, allreduce.nbytes, allreduce.calls, allreduce.phase) == ("all_reduce", 4e6, 1, "backward")
    nothing_hidden = predict(Plan(strategy="ddp"), WORK, LINK, nodes=2, overlap=0.0)
    assert nothing_hidden.compute_s == pytest.approx(0.05) and nothing_hidden.comm_s == pytest.approx(0.0402)
    assert nothing_hidden.step_s == pytest.approx(0.0902)
    assert nothing_hidden.images_per_s == pytest.approx(100 / 0.0902)
    assert nothing_hidden.efficiency == pytest.approx(0.05 / 0.0902)
    # all it can hide: the backward compute, 2/3 of 0.05 s, of the 0.0402 s
    all_hidden = predict(Plan(strategy="ddp"), WORK, LINK, nodes=2, overlap=1.0)
    assert all_hidden.exposed_s == pytest.approx(0.0402 - 0.05 * 2 / 3)
    half = predict(Plan(strategy="ddp"), WORK, LINK, nodes=2, overlap=0.5)
    assert half.exposed_s == pytest.approx(0.0402 - 0.5 * 0.05 * 2 / 3)
    # one node alone: no communication, the 1-rank rate
    assert predict(Plan(strategy="ddp"), WORK, LINK, nodes=1).images_per_s == pytest.approx(1000)


def test_the_update_in_the_next_forward_hides_backwards_transfer_behind_the_forward_too():
    # 40 MB: 0.402 s on the wire, far beyond backward's 0.05 x 2/3 s and the forward's 0.05 / 3 s
    slow = replace(WORK, param_bytes=4e7)
    plain, deferred = Plan(strategy="ddp"), Plan(strategy="ddp", update_in_next_forward=True)
    before = predict(plain, slow, LINK, nodes=2, overlap=1.0)
    after = predict(deferred, slow, LINK, nodes=2, overlap=1.0)
    assert before.exposed_s == pytest.approx(before.comm_s - 0.05 * 2 / 3)
    assert after.exposed_s == pytest.approx(before.comm_s - 0.05)  # the whole step's compute hides it
    assert predict(deferred, slow, LINK, nodes=2, overlap=0.5).exposed_s == pytest.approx(before.comm_s - 0.5 * 0.05)
    # 4 MB: the next forward hides the 0.0402 - 0.0333 s backward leaves; 1 MB: backward hides it all, nothing to gain
    assert before.comm_s > predict(plain, WORK, LINK, nodes=2, overlap=1.0).exposed_s > 0
    assert predict(deferred, WORK, LINK, nodes=2, overlap=1.0).exposed_s == pytest.approx(0)
    small = replace(WORK, param_bytes=1e6)
    assert predict(deferred, small, LINK, nodes=2, overlap=1.0).step_s == pytest.approx(
        predict(plain, small, LINK, nodes=2, overlap=1.0).step_s)
    assert predict(deferred, WORK, LINK, nodes=1).images_per_s == pytest.approx(1000)


def test_on_a_cpu_rank_of_one_core_the_update_in_the_next_forward_hides_nothing_more():
    """The transfer left running takes the CPU of the forward it was to hide behind (issue 45): with fewer than
    NEXT_FORWARD_CORES cores a rank (its threads, or its machine's cores over the ranks on it), as plain ddp."""
    cpu = Workload(param_bytes=4e7, global_batch=100, compute_s_per_sample=1e-3, machine_cores=2, threads_alone=1)
    plain, deferred = Plan(strategy="ddp"), Plan(strategy="ddp", update_in_next_forward=True)

    def exposed(plan, threads, machines):
        return predict(plan, cpu, LINK, nodes=4, overlap=1.0, machines=machines, threads_per_rank=threads).exposed_s

    assert exposed(deferred, 1, 4) == pytest.approx(exposed(plain, 1, 4))  # one thread a rank
    assert exposed(deferred, 2, 4) < exposed(plain, 2, 4)  # 2 threads, a 2-core machine each
    assert exposed(deferred, 2, 1) == pytest.approx(exposed(plain, 2, 1))  # 4 ranks on one 2-core machine
    assert predict(deferred, cpu, LINK, nodes=4, overlap=1.0).exposed_s < predict(plain, cpu, LINK, nodes=4,
                                                                                  overlap=1.0).exposed_s  # unknown


def test_buckets_add_latency_and_hooks_shrink_the_bytes():
    big = Workload(param_bytes=100 * 2**20, global_batch=100, compute_s_per_sample=1e-3)
    [buckets] = collectives(Plan(strategy="ddp"), big, 4)
    assert (buckets.calls, buckets.nbytes) == (4, 25 * 2**20)  # DDP's 25 MiB buckets
    # 4 ranks: each bucket 2 x 3 alpha + 1.5 x 25 MiB / B
    assert buckets.seconds(LINK, 4) == pytest.approx(4 * (6e-4 + 1.5 * 25 * 2**20 / 1e8))
    [half] = collectives(Plan(strategy="ddp", comm_hook="fp16"), WORK, 2)
    assert half.nbytes == 2e6
    assert bytes_sent_per_rank(Plan(strategy="ddp", comm_hook="bf16"), WORK, 4) == pytest.approx(1.5 * 2e6)


def test_powersgd_sends_its_factors_where_they_save_half():
    # 100 x 50 at rank 4: (100 + 50) x 4 = 600 elements, under half of 5000; 10 x 10: 80 x 2 >= 100, sent whole
    assert powersgd_elements([(100, 50)], vector_elements=10, rank=4) == 610
    assert powersgd_elements([(100, 50), (10, 10)], vector_elements=10, rank=4) == 710
    work = Workload(param_bytes=4 * (5000 + 100 + 10), global_batch=8, compute_s_per_sample=1e-3,
                    matrices=((100, 50), (10, 10)))
    [factors] = collectives(Plan(strategy="ddp", comm_hook="powersgd", powersgd_rank=4), work, 2)
    assert factors.calls == 3 and factors.calls * factors.nbytes == pytest.approx(4 * 710)  # P, Q, the vectors
    with pytest.raises(ConfigError, match="matrix shapes"):
        collectives(Plan(strategy="ddp", comm_hook="powersgd"), WORK, 2)


def test_bytes_sent_match_what_the_strategies_count():
    # ddp: 2 (N-1)/N G; zero1: that + (N-1)/N P (strategies/zero.py); fsdp: (2 gathers x P + G) (N-1)/N
    # (strategies/fsdp.py); ps: the server sends N-1 parameter copies
    assert bytes_sent_per_rank(Plan(strategy="ddp"), WORK, 4) == pytest.approx(6e6)
    assert bytes_sent_per_rank(Plan(strategy="zero1"), WORK, 4) == pytest.approx(6e6 + 3e6)
    assert bytes_sent_per_rank(Plan(strategy="fsdp"), WORK, 4) == pytest.approx(9e6)
    assert bytes_sent_per_rank(Plan(strategy="fsdp", reshard_after_forward=False), WORK, 4) == pytest.approx(6e6)
    assert bytes_sent_per_rank(Plan(strategy="fsdp", param_dtype_size=2), WORK, 4) == pytest.approx(6e6)
    assert bytes_sent_per_rank(Plan(strategy="ps"), WORK, 4) == pytest.approx(12e6)
    assert bytes_sent_per_rank(Plan(strategy="ddp"), WORK, 1) == 0


def test_fsdp_and_the_parameter_server_by_hand():
    units = Workload(param_bytes=4e6, global_batch=100, compute_s_per_sample=1e-3, fsdp_units=4)
    steps = collectives(Plan(strategy="fsdp"), units, 2)
    assert [(c.kind, c.nbytes, c.calls, c.phase) for c in steps] == [
        ("all_gather", 1e6, 4, "forward"), ("all_gather", 1e6, 4, "backward"), ("reduce_scatter", 1e6, 4, "backward")]
    # each: 4 x ((N-1) alpha + (N-1)/N 1 MB / B) = 4 x (1e-4 + 5e-3)
    assert predict(Plan(strategy="fsdp"), units, LINK, 2).comm_s == pytest.approx(3 * 4 * 5.1e-3)
    # ps on 3 ranks: 2 gradients in, 2 parameter copies out, one after the other: 4 x (alpha + 4 MB / B), exposed whole
    ps = predict(Plan(strategy="ps"), WORK, LINK, 3, overlap=1.0)
    assert ps.comm_s == pytest.approx(4 * (1e-4 + 0.04)) and ps.exposed_s == pytest.approx(ps.comm_s)


def test_memory_per_rank_by_hand():
    # Adam: parameters P, gradients P, two moments 2P; P = 4 MB
    assert memory_per_rank(Plan(strategy="ddp"), WORK, 8) == pytest.approx(16e6)
    assert memory_per_rank(Plan(strategy="zero1"), WORK, 8) == pytest.approx(8e6 + 8e6 / 8)
    assert memory_per_rank(Plan(strategy="fsdp"), WORK, 8) == pytest.approx(16e6 / 8 + 4e6)  # + one gathered unit
    assert memory_per_rank(Plan(strategy="fsdp", reshard_after_forward=False), WORK, 8) == pytest.approx(4e6 + 12e6 / 8)
    sgd = Workload(param_bytes=4e6, global_batch=1, compute_s_per_sample=1, optimizer_bytes=4e6)
    assert memory_per_rank(Plan(strategy="fsdp"), sgd, 1) == pytest.approx(12e6)


def test_ranks_sharing_a_node_share_its_compute():
    cpu = Workload(param_bytes=4e6, global_batch=100, compute_s_per_sample=1e-3)  # CPU: ranks split the cores
    assert predict(Plan(strategy="single"), cpu, LINK, 1, ranks_per_node=2).compute_s == pytest.approx(0.1)
    probed = Workload(param_bytes=4e6, global_batch=100, compute_s_per_sample=1e-3, rank_share={2: 0.6})
    assert predict(Plan(strategy="single"), probed, LINK, 1, ranks_per_node=2).compute_s == pytest.approx(0.1 / 1.2)
    # one node uses the local link, two the link between nodes
    local = Link("local", 0.0, 1e12, "shared memory")
    assert predict(Plan(strategy="ddp"), WORK, LINK, 1, 2, local_link=local).comm_s == pytest.approx(4e-6)
    assert predict(Plan(strategy="ddp"), WORK, LINK, 2, 1, local_link=local).comm_s == pytest.approx(0.0402)


def test_named_links_and_plans_refuse_what_they_do_not_know():
    assert named_link("1GBIT").bandwidth_bps == 125e6 and set(NAMED_LINKS) == {"100mbit", "1gbit", "10gbit", "100gbit"}
    with pytest.raises(ConfigError) as error:
        named_link("5g")
    assert str(error.value) == ("--link '5g' is no link the model knows; give one of 100mbit, 1gbit, 10gbit, 100gbit, "
                                "or leave it out to use the measured link.json.")
    with pytest.raises(ConfigError, match="no formulas for strategy 'deepspeed'"):
        Plan(strategy="deepspeed")


def test_curves_reach_256_nodes_and_fall_off_with_a_slow_link():
    assert node_counts() == [1, 2, 4, 8, 16, 32, 64, 128, 256] and node_counts(100)[-1] == 100
    work = Workload(param_bytes=4e6, global_batch=256, compute_s_per_sample=1e-3)  # a sample for each of 256 ranks
    slow = curve(Plan(strategy="ddp"), work, named_link("100mbit"), overlap=0.5)
    fast = curve(Plan(strategy="ddp"), work, named_link("100gbit"), overlap=0.5)
    assert [p.nodes for p in slow] == node_counts() and slow[-1].ranks == 256
    assert all(s.images_per_s < f.images_per_s for s, f in zip(slow[1:], fast[1:]))
    assert fast[-1].efficiency > slow[-1].efficiency


def test_split_fits_on_the_smaller_shapes():
    points = [Measured(1, w, 100.0) for w in (1, 2, 4, 8)]
    fit_on, held = split_for_fit(points)
    assert [p.workers for p in fit_on] == [1, 2] and [p.workers for p in held] == [4, 8]
    hosts = [Measured(n, n, 100.0) for n in (1, 2, 4)] + [Measured(2, 2, 90.0)]
    fit_on, held = split_for_fit(hosts)
    assert [(p.nodes, p.images_per_s) for p in fit_on] == [(1, 100.0), (2, 100.0), (2, 90.0)] and held[0].nodes == 4
    assert split_for_fit([Measured(1, 1, 1.0)]) == ([Measured(1, 1, 1.0)], [])


def test_nodes_that_share_one_machine_share_its_cores():
    # the lab cluster: hosts that are namespaces of one 2-core kernel, a rank of 1 thread each; the 1-worker run that
    # gave 1 ms a sample had 1 thread too
    lab = Workload(param_bytes=4e6, global_batch=100, compute_s_per_sample=1e-3, machine_cores=2, threads_alone=1)
    assert lab.machine_share(2, 1, 1) == 1.0 and lab.machine_share(4, 1, 1) == 0.5  # 2 ranks a core, from 4 on
    assert lab.machine_share(4, 1, 2) == 0.5 and lab.machine_share(8, 2, 1) == 0.5  # 2 threads of 1 core; 2 machines
    alone_on_two = Workload(param_bytes=4e6, global_batch=100, compute_s_per_sample=1e-3, machine_cores=2,
                            threads_alone=2)
    assert alone_on_two.machine_share(2, 1, 1) == 0.5  # a rank of 1 thread against a 1-worker run of 2
    # 100 samples over 4 ranks at half the 1-worker rate: 25 x 1 ms / 0.5; on 4 machines of their own, 25 ms
    assert predict(Plan(strategy="single"), lab, LINK, 4, machines=1, threads_per_rank=1).compute_s == pytest.approx(0.05)
    assert predict(Plan(strategy="single"), lab, LINK, 4, machines=4, threads_per_rank=1).compute_s == pytest.approx(0.025)
    assert predict(Plan(strategy="single"), lab, LINK, 4).compute_s == pytest.approx(0.025)
    # a count missing: no machine sharing to count, each node its own machine
    assert Workload(param_bytes=4e6, global_batch=100, compute_s_per_sample=1e-3).machine_share(4, 1, 1) is None
    # held out on the lab: fitted on 1 and 2 hosts, the 4-host point predicted with its ranks at half speed
    plan, truth = Plan(strategy="ddp"), 0.3
    points = [Measured(n, n, predict(plan, lab, LINK, n, 1, truth, machines=1, threads_per_rank=1).images_per_s, 1, 1)
              for n in (1, 2, 4)]
    calibration = calibrate(plan, Workload(param_bytes=4e6, global_batch=100, compute_s_per_sample=5e-3,
                                           machine_cores=2), points, LINK)
    assert calibration.work.threads_alone == 1 and calibration.overlap == pytest.approx(truth)
    assert [m.nodes for m, _ in calibration.held_out] == [4] and abs(calibration.errors()[0][2]) < 1e-9


def test_moving_bytes_between_nodes_costs_a_cpu_rank_its_cores_time():
    # 2 ns of CPU a byte sent; ddp's all-reduce of 4 MB: a rank sends 2(N-1)/N x 4 MB
    lab = Workload(param_bytes=4e6, global_batch=100, compute_s_per_sample=1e-3, machine_cores=2, threads_alone=1,
                   cores_busy_alone=1.0, comm_cpu_s_per_byte=2e-9)
    ddp = Plan(strategy="ddp")
    two = predict(ddp, lab, LINK, 2, machines=1, threads_per_rank=1)  # a core each: 4 MB x 2 ns = 8 ms
    assert two.comm_cpu_s == pytest.approx(8e-3)
    assert two.step_s == pytest.approx(two.compute_s + 8e-3 + two.exposed_s)
    assert two.efficiency == pytest.approx(two.compute_s / two.step_s)
    # 4 ranks on 2 cores: 6 MB x 2 ns = 12 ms of CPU, on half a core 24 ms; on 4 machines of their own, 12 ms
    assert predict(ddp, lab, LINK, 4, machines=1, threads_per_rank=1).comm_cpu_s == pytest.approx(24e-3)
    assert predict(ddp, lab, LINK, 4, machines=4, threads_per_rank=1).comm_cpu_s == pytest.approx(12e-3)
    # a rank of several cores waits for one core's work: no shorter than the CPU time itself
    wide = Workload(param_bytes=4e6, global_batch=100, compute_s_per_sample=1e-3, cores_busy_alone=8.0,
                    comm_cpu_s_per_byte=2e-9)
    assert predict(ddp, wide, LINK, 4).comm_cpu_s == pytest.approx(12e-3)
    # none on one node (shared memory, loopback), none on GPUs, none unmeasured
    assert predict(ddp, lab, LINK, 1, 2).comm_cpu_s == 0.0
    assert predict(ddp, Workload(param_bytes=4e6, global_batch=100, compute_s_per_sample=1e-3,
                                 ranks_share_a_node=False, comm_cpu_s_per_byte=2e-9), LINK, 2).comm_cpu_s == 0.0
    assert predict(ddp, WORK, LINK, 2).comm_cpu_s == 0.0


def _lab_point(plan: Plan, lab: Workload, nodes: int, overlap: float, threads: int = 1) -> Measured:
    """A lab point as a run would measure it: its images/s, and its ranks' CPU use (compute's CPU at the 1-worker
    run's CPU per sample, plus moving the bytes) over its step."""
    predicted = predict(plan, lab, LINK, nodes, 1, overlap, machines=1, threads_per_rank=threads)
    cpu_s = (lab.batch(nodes) / nodes * lab.compute_s_per_sample * lab.cores_busy_alone
             + (bytes_sent_per_rank(plan, lab, nodes) * lab.comm_cpu_s_per_byte if nodes > 1 else 0.0))
    return Measured(nodes, nodes, predicted.images_per_s, 1, threads, 100 * cpu_s / predicted.step_s)


def test_calibrate_recovers_the_cpu_a_byte_costs_from_the_runs_cpu_use():
    plan, truth = Plan(strategy="ddp"), Workload(param_bytes=4e6, global_batch=100, compute_s_per_sample=1e-3,
                                                 machine_cores=2, threads_alone=1, cores_busy_alone=1.0,
                                                 comm_cpu_s_per_byte=3e-9)
    points = [_lab_point(plan, truth, n, 0.3) for n in (1, 2, 4)]
    start = Workload(param_bytes=4e6, global_batch=100, compute_s_per_sample=5e-3, machine_cores=2)
    calibration = calibrate(plan, start, points, LINK)
    assert calibration.work.cores_busy_alone == pytest.approx(1.0)
    assert calibration.work.comm_cpu_s_per_byte == pytest.approx(3e-9) and calibration.overlap == pytest.approx(0.3)
    assert [m.nodes for m, _ in calibration.held_out] == [4] and abs(calibration.errors()[0][2]) < 1e-9
    # left out, the 4-host point's ranks (half a core each) would be predicted faster than they ran
    blind = calibrate(plan, start, [replace(p, cpu_util_pct=None) for p in points], LINK)
    assert blind.work.comm_cpu_s_per_byte == 0.0 and blind.errors()[0][2] > 0.01
    # a rank that used no more CPU than its compute: nothing to count, never a negative cost
    idle = [replace(p, cpu_util_pct=1.0) if p.nodes > 1 else p for p in points]
    assert comm_cpu_per_byte(plan, calibration.work, idle) == 0.0


def test_calibrate_recovers_a_known_overlap_and_predicts_the_held_out_points():
    truth = 0.4
    plan = Plan(strategy="ddp")
    points = [Measured(n, n, predict(plan, WORK, LINK, n, 1, truth).images_per_s) for n in (1, 2, 4, 8)]
    start = Workload(param_bytes=4e6, global_batch=100, compute_s_per_sample=5e-3, ranks_share_a_node=False)
    calibration = calibrate(plan, start, points, LINK)
    assert calibration.work.compute_s_per_sample == pytest.approx(1e-3)  # from the 1-worker point, not the guess
    assert calibration.overlap == pytest.approx(truth) and calibration.overlap_fitted
    assert [m.nodes for m, _ in calibration.held_out] == [4, 8]
    assert all(abs(error) < 1e-9 for _, _, error in calibration.errors())
    # no multi-rank point to fit on: the default overlap, said to be so
    assert fit_overlap(plan, WORK, points[:1], LINK) is None
    lone = calibrate(plan, WORK, points[:2], LINK, default_overlap=0.25)
    assert lone.overlap == 0.25 and not lone.overlap_fitted and len(lone.errors()) == 1


def test_a_fixed_global_batch_ends_the_curve_where_ranks_would_get_no_sample():
    small = Workload(param_bytes=4e6, global_batch=8, compute_s_per_sample=1e-3, ranks_share_a_node=False)
    assert [p.ranks for p in curve(Plan(strategy="ddp"), small, LINK)] == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="16 ranks share a global batch of 8"):
        predict(Plan(strategy="ddp"), small, LINK, 16)
    # weak scaling: 8 samples a rank, the compute per step stays 8 ms and the curve reaches 256 nodes
    weak = Workload(param_bytes=4e6, global_batch=8, batch_per_rank=8, compute_s_per_sample=1e-3,
                    ranks_share_a_node=False)
    far = curve(Plan(strategy="ddp"), weak, LINK)
    assert far[-1].nodes == 256 and far[-1].compute_s == pytest.approx(8e-3)
    assert far[-1].images_per_s == pytest.approx(256 * 8 / far[-1].step_s)


def test_the_model_reads_a_strategys_traffic_from_its_spec(monkeypatch):
    """No strategy name in the formulas: a spec added to SPECS with its traffic is timed, counted and sized from it."""
    from dptrain.config import SPECS, Exchange, StrategySpec, Traffic

    local_sgd = StrategySpec(name="local-sgd", about="averages every few steps", traffic=Traffic(
        exchanges=(Exchange("all_reduce", "parameters", "after", "one"),), sharded=("optim",)))
    monkeypatch.setitem(SPECS, "local-sgd", local_sgd)
    [average] = collectives(Plan(strategy="local-sgd"), WORK, 4)
    assert (average.kind, average.nbytes, average.calls, average.phase) == ("all_reduce", 4e6, 1, "after")
    assert bytes_sent_per_rank(Plan(strategy="local-sgd"), WORK, 4) == 2 * 3 / 4 * 4e6
    assert memory_per_rank(Plan(strategy="local-sgd"), WORK, 4) == 4e6 + 4e6 + 8e6 / 4
    assert predict(Plan(strategy="local-sgd"), WORK, LINK, nodes=4, overlap=1.0).exposed_s == average.seconds(LINK, 4)


def test_local_sgd_and_diloco_exchange_once_in_their_period():
    """The parameters' all-reduce after the step, once in H steps: its time, bytes and own CPU a step are 1/H of one
    exchange's; H = 1 sends what ddp sends."""
    [average] = collectives(Plan(strategy="local_sgd", period=16), WORK, 2)
    assert (average.kind, average.nbytes, average.calls, average.phase, average.every) == ("all_reduce", 4e6, 1,
                                                                                           "after", 16)
    once = LINK.seconds("all_reduce", 2, 4e6)
    for strategy in ("local_sgd", "diloco"):
        every16 = predict(Plan(strategy=strategy, period=16), WORK, LINK, nodes=2, overlap=1.0)
        assert every16.comm_s == every16.exposed_s == pytest.approx(once / 16)  # after the step: nothing hides it
        assert every16.bytes_sent == pytest.approx(4e6 / 16)
        assert bytes_sent_per_rank(Plan(strategy=strategy, period=1), WORK, 2) == bytes_sent_per_rank(Plan(), WORK, 2)
    with pytest.raises(ConfigError, match="a period of 1 step or more, not 0"):
        Plan(strategy="local_sgd", period=0)


def test_diloco_streamed_hides_its_exchange_behind_the_steps_it_runs_behind():
    """overlap_steps T: the exchange of every H steps hides behind T steps' compute, as far as the overlap lets it;
    the rest stays exposed. Local SGD and DiLoCo hold the run's model beside their own, and a streamed DiLoCo a copy of
    what it sent."""
    fast = replace(WORK, compute_s_per_sample=0.5e-3)
    once = LINK.seconds("all_reduce", 2, 4e6)  # 40.2 ms; a step's compute on 2 ranks: 25 ms
    waited = predict(Plan(strategy="diloco", period=16), fast, LINK, nodes=2, overlap=0.5)
    assert waited.exposed_s == pytest.approx(once / 16)
    for behind, hidden in ((1, 0.025), (2, once)):  # behind 1 step: its 25 ms of compute; 2 steps: the whole exchange
        streamed = predict(Plan(strategy="diloco", period=16, overlap_steps=behind), fast, LINK, nodes=2, overlap=0.5)
        assert streamed.comm_s == pytest.approx(once / 16)
        assert streamed.exposed_s == pytest.approx((once - 0.5 * hidden) / 16)
    # a CPU rank of one core: the transfer takes the core the inner steps compute on, and hides nothing
    cpu = replace(fast, ranks_share_a_node=True, machine_cores=2, threads_alone=1)
    one_core, two_cores = (predict(Plan(strategy="diloco", period=16, overlap_steps=2), cpu, LINK, nodes=2,
                                   overlap=0.5, machines=2, threads_per_rank=t) for t in (1, 2))
    assert one_core.exposed_s == pytest.approx(once / 16) and two_cores.exposed_s < once / 16
    assert memory_per_rank(Plan(strategy="local_sgd"), WORK, 2) == pytest.approx(4e6 * 2 + 4e6 + 8e6)
    assert memory_per_rank(Plan(strategy="diloco", period=32, overlap_steps=8), WORK, 2) == pytest.approx(4e6 * 3 + 4e6 + 8e6)
    assert memory_per_rank(Plan(strategy="diloco", period=32, overlap_steps=8), WORK, 1) == pytest.approx(4e6 + 4e6 + 8e6)
    for bad in (-1, 32):
        with pytest.raises(ConfigError, match=f"overlap steps from 0 to fewer than the period \\(32\\), not {bad}"):
            Plan(strategy="diloco", period=32, overlap_steps=bad)


def test_a_ways_own_cpu_is_added_to_the_step_as_the_hook_probe_measured_it():
    """A compressing hook's own CPU every step, an averaging's every period steps (Workload.own_cpu_s by
    Plan.own_cpu_key); DDP's own all-reduce and one rank have none."""
    cpu = Workload(param_bytes=4e6, global_batch=100, compute_s_per_sample=1e-3, cores_busy_alone=1.0,
                   powersgd_bytes=1e5, own_cpu_s={"powersgd": 0.02, "fp16": 0.004, "local_sgd": 0.008})
    assert [Plan(comm_hook=h).own_cpu_key for h in ("allreduce", "ring", "fp16", "powersgd")] == [None, None, "fp16",
                                                                                                 "powersgd"]
    assert Plan(strategy="local_sgd").own_cpu_key == "local_sgd" and Plan(strategy="fsdp").own_cpu_key is None
    without = replace(cpu, own_cpu_s={})
    for plan, per_step in ((Plan(comm_hook="powersgd"), 0.02), (Plan(strategy="local_sgd", period=4), 0.002),
                           (Plan(), 0.0)):
        ours, theirs = (predict(plan, w, LINK, nodes=2, machines=2, threads_per_rank=1) for w in (cpu, without))
        assert ours.own_cpu_s == pytest.approx(per_step)
        assert ours.step_s - theirs.step_s == pytest.approx(per_step)
    assert predict(Plan(comm_hook="powersgd"), cpu, LINK, nodes=1, ranks_per_node=1).own_cpu_s == 0.0
    # on a rank of half a core (2 ranks of a 1-core machine) it takes twice as long
    assert predict(Plan(comm_hook="powersgd"), replace(cpu, rank_share={2: 0.5}), LINK, nodes=1,
                   ranks_per_node=2).own_cpu_s == pytest.approx(0.04)
