"""The clock seam: offset estimation, the authority clock, and the real authorities."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from celery_driftsafe.exceptions import ClockError
from celery_driftsafe.store.clock import (
    AuthorityClock,
    DatabaseAuthority,
    LocalAuthority,
    RedisAuthority,
    measure_offset,
)
from celery_driftsafe.testing import FakeClock, UnreachableAuthority
from tests.support import T0


class ScriptedAuthority:
    """Answers ``true + offset`` and advances the fake clocks by scripted round trips."""

    name = "scripted"

    def __init__(self, clock: FakeClock, offset: float, rtts: list[float]) -> None:
        self.clock = clock
        self.offset = offset
        self.rtts = iter(rtts)

    def read(self) -> datetime:
        rtt = next(self.rtts)
        self.clock.advance(rtt / 2)
        answer = self.clock.now() + timedelta(seconds=self.offset)
        self.clock.advance(rtt / 2)
        return answer


def test_offset_is_authority_minus_local_midpoint_lowest_rtt_wins() -> None:
    local = FakeClock(T0)
    authority = ScriptedAuthority(local, offset=2.5, rtts=[0.040, 0.002, 0.030])
    sample = measure_offset(authority, 3, wall=local.now, monotonic=local.monotonic)
    assert sample.offset == pytest.approx(2.5, abs=1e-9)
    assert sample.rtt == pytest.approx(0.002)
    assert sample.error_bound == pytest.approx(0.001)


def test_asymmetric_round_trip_error_stays_within_half_rtt() -> None:
    local = FakeClock(T0)

    class Asymmetric:
        name = "asym"

        def read(self) -> datetime:
            local.advance(0.009)  # request slow, answer fast
            answer = local.now() - timedelta(seconds=1)
            local.advance(0.001)
            return answer

    sample = measure_offset(Asymmetric(), 1, wall=local.now, monotonic=local.monotonic)
    assert abs(sample.offset - (-1.0)) <= sample.error_bound


def test_authority_clock_extrapolates_on_monotonic_and_resyncs() -> None:
    local = FakeClock(T0)
    authority = ScriptedAuthority(local, offset=-4.0, rtts=[0.0] * 10)
    clock = AuthorityClock(
        authority,
        samples=1,
        resync_seconds=60,
        monotonic=local.monotonic,
        wall=local.now,
        sleeper=local.sleep,
    )
    assert clock.now() == T0 - timedelta(seconds=4)
    local.advance(30)
    assert clock.now() == T0 + timedelta(seconds=26)
    assert not clock.needs_sync()
    local.advance(30)
    assert clock.needs_sync()
    authority.offset = -3.0  # the node's clock was stepped: the next sync sees it
    assert clock.now() == T0 + timedelta(seconds=57)


def test_unreachable_authority_raises_clock_error() -> None:
    with pytest.raises(ClockError, match="unreachable"):
        measure_offset(UnreachableAuthority(), 1)


def test_local_authority_is_the_wall_clock() -> None:
    assert LocalAuthority(lambda: T0).read() == T0


def test_redis_authority_reads_server_time(redis_client: object) -> None:
    before = datetime.now(UTC)
    answer = RedisAuthority(redis_client).read()
    after = datetime.now(UTC)
    assert answer.tzinfo is UTC
    assert before - timedelta(seconds=1) <= answer <= after + timedelta(seconds=1)


def test_redis_authority_unreachable_is_clock_error() -> None:
    import redis

    client = redis.Redis(port=1, socket_connect_timeout=0.2)
    with pytest.raises(ClockError, match="redis clock unreachable"):
        RedisAuthority(client).read()


@pytest.mark.django_db
def test_database_authority_reads_server_time() -> None:
    before = datetime.now(UTC)
    answer = DatabaseAuthority().read()
    after = datetime.now(UTC)
    assert answer.utcoffset() == timedelta(0)
    assert before - timedelta(seconds=1) <= answer <= after + timedelta(seconds=1)


def test_fake_clock_rejects_naive_and_backwards() -> None:
    with pytest.raises(ValueError, match="aware"):
        FakeClock(datetime(2026, 1, 1))
    clock = FakeClock(T0)
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1)
    clock.sleep(2.5)
    assert clock.sleeps == [2.5]
    assert clock.now() == T0 + timedelta(seconds=2.5)


def test_the_authority_outside_a_beat_is_one_cached_clock_and_can_be_injected() -> None:
    from django.test import override_settings

    from celery_driftsafe.definitions.changes import authority_now
    from celery_driftsafe.store.clock import authority_clock
    from celery_driftsafe.testing import inject_authority_clock

    with override_settings(DRIFTSAFE={"TIME_AUTHORITY": "local"}):
        first = authority_clock()
        assert authority_clock() is first  # cached
        with override_settings(
            DRIFTSAFE={"TIME_AUTHORITY": "local", "MAX_CLOCK_OFFSET_SECONDS": 7}
        ):
            assert authority_clock() is not first  # a settings change follows
        fake = FakeClock(datetime(2030, 1, 1, tzinfo=UTC))
        with inject_authority_clock(fake):
            assert authority_clock() is fake
            assert authority_now() == datetime(2030, 1, 1, tzinfo=UTC)
        assert authority_clock() is not fake
