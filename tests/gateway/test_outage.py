"""The store (PostgreSQL) or Redis down under load, each an instance of the test's own, stopped and started again:
the gateway keeps serving the keys it knows, refuses others 503 `store_unavailable`, counts limits in process
while Redis is away, loses no usage record and recovers without a restart."""
import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from sqlalchemy import create_engine, text

from inferd.gateway.auth import STORE_RETRY_S, KeyCache
from inferd.gateway.charges import Charges, Plan
from inferd.gateway.keys import generate_key
from inferd.gateway.limits import Charge, RateLimited
from inferd.gateway.redis_limiter import LOCAL_RETRY_S, PREFIX, REDIS_TIMEOUT_S, RedisLimiter
from inferd.gateway.store import Store
from inferd.protocol.errors import AuthenticationFailed, ServiceUnavailable
from tests.gateway.services import OwnPostgres, OwnRedis
from tests.server import server_process


@pytest.fixture
def postgres():
    pg = OwnPostgres()
    pg.start()
    yield pg
    pg.remove()


@pytest.fixture
def own_redis(tmp_path):
    r = OwnRedis(str(tmp_path))
    r.start()
    yield r
    r.stop()


async def test_keys_seen_valid_work_through_a_store_outage_and_unknown_ones_are_refused_503(postgres):
    store = Store(postgres.url)
    store.migrate()
    store.create_tenant("t")
    store.create_tenant("budgeted", budget_usd=10.0)
    (_, known), (_, unseen) = store.create_key("t"), store.create_key("t")
    budgeted, _ = store.create_key("budgeted")
    keys = KeyCache(store, ttl_s=0.05)
    try:
        assert (await keys.authenticate(f"Bearer {known.key}")).tenant.name == "t"
        postgres.stop()
        with pytest.raises(ServiceUnavailable) as blind:  # a budget whose spend the store cannot say is not spent
            await Charges(store).of(budgeted, "m", Plan(10, 10, 1, 0.001, None, False))
        assert blind.value.code == "store_unavailable"
        await asyncio.sleep(0.1)  # past the TTL: the known key's entry is stale
        assert (await keys.authenticate(f"Bearer {known.key}")).tenant.name == "t"
        with pytest.raises(ServiceUnavailable) as refused:
            await keys.authenticate(f"Bearer {unseen.key}")
        assert refused.value.code == "store_unavailable" and refused.value.headers == {"retry-after": "1"}
        reads = keys.store_reads
        for _ in range(100):  # within STORE_RETRY_S of a failed read: refused without trying the store
            with pytest.raises(ServiceUnavailable):
                await keys.authenticate(f"Bearer {generate_key().key}")
        assert keys.store_reads == reads
        with pytest.raises(AuthenticationFailed):  # a wrong secret for a cached key id is still wrong
            await keys.authenticate(f"Bearer {known.key[:-4]}abcd")
        postgres.start()
        await asyncio.sleep(STORE_RETRY_S)
        assert (await keys.authenticate(f"Bearer {unseen.key}")).tenant.name == "t"
    finally:
        store.close()


async def test_redis_down_limits_count_in_process_and_its_leases_are_settled_when_it_is_back(own_redis):
    limiter = RedisLimiter(own_redis.url)
    direct = redis.Redis(port=own_redis.port)
    conc = [Charge("outage:concurrency", "concurrency", "max_concurrency", "tenant", 2, 1)]
    try:
        held = await limiter.reserve(conc)  # in Redis, settled during the outage
        own_redis.stop()
        started = time.monotonic()
        local = [await limiter.reserve(conc), await limiter.reserve(conc)]
        with pytest.raises(RateLimited):  # in process, the limit still holds (for this gateway)
            await limiter.reserve(conc)
        # no call waited out a socket timeout (under two CI workers the three calls have taken 0.8 s of CPU waits)
        assert time.monotonic() - started < REDIS_TIMEOUT_S and not limiter.shared and limiter.leases_held == 3
        for reservation in (held, *local):
            await limiter.settle(reservation, {})
        assert limiter.leases_held == 1  # the Redis one, until Redis has it settled
        own_redis.start()
        assert direct.zcard(PREFIX + "outage:concurrency") == 1  # Redis kept the lease its settle could not free
        for _ in range(40):  # no request comes: the limiter tries Redis again by itself
            await asyncio.sleep(LOCAL_RETRY_S / 10)
            if limiter.leases_held == 0:
                break
        assert limiter.shared and direct.zcard(PREFIX + "outage:concurrency") == 0 and limiter.leases_held == 0
        assert len([await limiter.reserve(conc), await limiter.reserve(conc)]) == 2
    finally:
        await limiter.close()
        direct.close()


def test_serve_keeps_answering_through_a_store_and_redis_outage_and_loses_no_record(postgres, own_redis, tmp_path):
    store = Store(postgres.url)
    store.migrate()
    tenant = store.create_tenant("outage", limits={"rpm": 100_000, "max_concurrency": 16})
    (_, known), (_, unseen) = store.create_key("outage"), store.create_key("outage")
    store.close()
    log_path = tmp_path / "serve.log"
    flags = ("--db", postgres.url, "--redis-url", own_redis.url, "--max-model-len", "256", "--kv-cache-gib", "0.1",
             "--num-threads", "1")
    answers, stop = [], threading.Event()

    def load(client: httpx.Client) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            r = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {known.key}"},
                            json={"messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 4})
            answers.append((r.status_code, r.headers.get("x-request-id"), time.monotonic()))

    def chat(client: httpx.Client, key: str) -> httpx.Response:
        return client.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                           json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})

    with server_process(log_path, *flags) as (_, url), httpx.Client(base_url=url, timeout=60) as client:
        assert chat(client, known.key).status_code == 200
        with ThreadPoolExecutor(3) as pool:
            loaders = [pool.submit(load, client) for _ in range(3)]
            time.sleep(1.0)
            postgres.stop()
            own_redis.stop()
            down_s = time.monotonic()
            time.sleep(0.6)  # past the key cache's TTL
            refused = chat(client, unseen.key)
            files = client.get("/v1/files", headers={"authorization": f"Bearer {known.key}"})  # a route on the store
            time.sleep(2.0)
            postgres.start()
            own_redis.start()
            up_s = time.monotonic()
            while (back := chat(client, unseen.key)).status_code != 200 and time.monotonic() - up_s < 10:
                time.sleep(0.2)
            recovered_s = time.monotonic() - up_s
            time.sleep(0.5)
            stop.set()
            for f in loaders:
                f.result()
        during = [a for a in answers if down_s < a[2] < up_s]
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "store_unavailable"
        assert files.status_code == 503 and files.json()["error"]["code"] == "store_unavailable", files.text
        assert back.status_code == 200 and recovered_s < 3.0, (back.text, recovered_s)
        assert len(during) >= 3 and {a[0] for a in answers} == {200}, {a[0] for a in answers}
        served = {a[1] for a in answers}  # a refusal before its key was known has no record
        engine = create_engine(postgres.url)
        deadline = time.monotonic() + 10
        while True:  # the journal's records reach the store within a few seconds of its return
            with engine.connect() as conn:
                rows = conn.execute(text("SELECT request_id, status FROM usage_records")).all()
            if served <= {r.request_id for r in rows} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        engine.dispose()
        mine = [r for r in rows if r.request_id in served]
        assert len(mine) == len(served) == len({r.request_id for r in mine})  # none lost, none twice
        pending = [line for line in client.get("/metrics").text.splitlines()
                   if line.startswith("inferd_gateway_usage_records_pending")]
        assert pending == ["inferd_gateway_usage_records_pending 0.0"], pending
        for _ in range(50):  # the last requests' Redis settles may still be on their way
            leases_line = [line for line in client.get("/metrics").text.splitlines()
                           if line.startswith("inferd_gateway_concurrency_leases")]
            if leases_line == ["inferd_gateway_concurrency_leases 0.0"]:
                break
            time.sleep(0.2)
        assert leases_line == ["inferd_gateway_concurrency_leases 0.0"], leases_line
        leases = redis.Redis(port=own_redis.port)
        assert leases.zcard(f"{PREFIX}{tenant.id}:concurrency") == 0  # no lease left taken by the outage
        leases.close()
    assert '"internal error"' not in log_path.read_text()  # no request met an exception the gateway did not map
