"""Waiting claims are woken one per claimable run, oldest first, and no wake-up is lost."""

from __future__ import annotations

from services.orchestrator.wakeups import Wakeups


async def test_one_wake_up_wakes_one_claim_the_longest_waiting() -> None:
    line = Wakeups()
    first, second, third = line.ticket(), line.ticket(), line.ticket()
    line.wake(["run-a"])
    assert [first.done(), second.done(), third.done()] == [True, False, False]
    assert first.result() == "run-a"
    line.wake(["run-b", ""])
    assert (second.result(), third.result()) == ("run-b", "")


async def test_a_claim_that_left_the_line_is_skipped_and_not_counted() -> None:
    line = Wakeups()
    gone, waiting = line.ticket(), line.ticket()
    line.leave(gone, claimed=None)  # gave up before any wake-up: nothing to pass on
    assert gone.cancelled()
    line.wake(["run-a"])
    assert waiting.result() == "run-a"


async def test_a_wake_up_for_a_run_its_holder_did_not_take_goes_to_the_next_in_line() -> None:
    for claimed in ("run-b", None):  # it claimed another run, or gave up / went away
        line = Wakeups()
        looking, next_in_line = line.ticket(), line.ticket()
        line.wake(["run-a"])  # arrives while `looking` is in its transaction
        line.leave(looking, claimed=claimed)
        assert next_in_line.result() == "run-a"


async def test_a_claim_that_took_the_run_it_was_woken_for_passes_nothing_on() -> None:
    line = Wakeups()
    looking, other = line.ticket(), line.ticket()
    line.wake(["run-a"])
    line.leave(looking, claimed="run-a")
    assert not other.done()


async def test_a_wake_up_for_an_unknown_run_is_passed_on_after_any_claim() -> None:
    line = Wakeups()
    looking, other = line.ticket(), line.ticket()
    line.wake([""])
    line.leave(looking, claimed="run-a")  # "" might have meant another run
    assert other.done()


async def test_a_claim_that_looks_again_keeps_its_wake_up() -> None:
    line = Wakeups()
    looking, other = line.ticket(), line.ticket()
    line.wake(["run-a"])
    line.leave(looking, claimed=None, looking_again=True)
    assert not other.done()


async def test_timed_out_tickets_do_not_pile_up() -> None:
    line = Wakeups()
    for _ in range(1000):
        ticket = line.ticket()
        ticket.cancel()  # as asyncio.wait_for does on its timeout
        line.leave(ticket, claimed=None, looking_again=True)
    survivor = line.ticket()
    line.wake(["run-a"])
    assert survivor.done()
    assert len(line._waiting) == 0


async def test_every_wake_up_advances_the_generation_and_wake_all_wakes_everyone() -> None:
    line = Wakeups()
    before = line.generation
    line.wake(["run-a"])  # nobody waiting: the run stays for the next claim's look
    assert line.generation == before + 1
    tickets = [line.ticket() for _ in range(5)]
    line.wake_all()
    assert all(t.done() for t in tickets) and line.generation == before + 2
