"""TrainState's questions about where the loop stands, which fit() asks at each epoch's start (a resume may put it
anywhere: mid-epoch, after an epoch's last step with its event owed, or at the run's end)."""

from __future__ import annotations

import torch

from dptrain.train_state import TrainState

CPU = torch.device("cpu")


def state_at(step: int, epoch: int, started: bool, reported: bool) -> TrainState:
    state = TrainState(step=step, epoch=epoch, epoch_reported=reported)
    state.epoch_sums = torch.zeros(3, dtype=torch.float64) if started else None
    return state


def test_a_fresh_run_owes_nothing_and_is_not_complete():
    state = TrainState()
    assert not state.resumes_mid_epoch(0) and not state.owes_epoch_event() and not state.is_complete(10)
    assert TrainState().is_complete(0)  # no step to train: done


def test_a_resume_mid_epoch_continues_that_epoch_only():
    state = state_at(step=5, epoch=1, started=True, reported=False)
    assert state.resumes_mid_epoch(1) and not state.resumes_mid_epoch(2) and not state.resumes_mid_epoch(0)
    assert state.owes_epoch_event() and not state.is_complete(10)


def test_a_run_stopped_after_its_last_step_but_before_its_event_is_not_complete():
    # the last epoch's steps all done, its evaluation and event not: the resume must emit them
    state = state_at(step=10, epoch=1, started=True, reported=False)
    assert state.owes_epoch_event() and not state.is_complete(10)
    state.epoch_reported = True
    assert not state.owes_epoch_event() and state.is_complete(10)


def test_after_an_epoch_is_reported_the_next_one_starts_afresh():
    state = state_at(step=4, epoch=0, started=True, reported=True)
    assert not state.owes_epoch_event() and not state.is_complete(8)
    assert not state.resumes_mid_epoch(1)  # epoch 1 starts: start_epoch resets the sums
    state.start_epoch(1, CPU)
    assert state.resumes_mid_epoch(1) and state.owes_epoch_event() and state.batches_consumed == 0


def test_entering_an_epoch_starts_it_unless_a_resume_stands_mid_way_in_it():
    resumed = state_at(step=6, epoch=1, started=True, reported=False)
    resumed.batches_consumed, resumed.epoch_seen = 2, 64
    resumed.epoch_sums += 1.0
    resumed.enter_epoch(1, CPU)  # the snapshot's epoch: its position and sums go on
    assert (resumed.batches_consumed, resumed.epoch_seen, resumed.epoch_sums.tolist()) == (2, 64, [1.0, 1.0, 1.0])
    resumed.enter_epoch(2, CPU)  # the next one starts afresh
    assert (resumed.epoch, resumed.batches_consumed, resumed.epoch_seen, resumed.epoch_sums.tolist()) == (2, 0, 0, [0.0] * 3)


def test_the_steps_left_in_an_epoch_are_its_unconsumed_batches_or_fewer_at_max_steps():
    state = state_at(step=6, epoch=1, started=True, reported=False)
    state.batches_consumed = 2  # of 4 per epoch
    assert state.steps_left_in_epoch(4, total_steps=8) == 2
    assert state.steps_left_in_epoch(4, total_steps=7) == 1  # train.max_steps ends the run inside it
