import time, uuid, statistics
from services.config import MergingSettings
from gateway.fleet.similarity import SimilarityIndex
from services.storage.db import init_db, session_factory
from services.storage import crud
idx = SimilarityIndex(MergingSettings())
ids = list(range(1000, 1060))
ts = []
for i in range(200):
    a = time.perf_counter(); s = idx.sketch(ids); idx.most_similar(s); ts.append((time.perf_counter() - a) * 1000)
print("sketch+query median %.2f ms" % statistics.median(ts))
db = session_factory(init_db("sqlite:////tmp/gwcost.db"))
ts = []
for i in range(50):
    a = time.perf_counter()
    with db() as session:
        crud.create_request(session=session, request_id=uuid.uuid4().hex, model="m", endpoint="chat.completions", prompt_tokens=50, params={"max_tokens": 4}, priority="normal", route="sd", pool="cpu", api_key_id=None)
    ts.append((time.perf_counter() - a) * 1000)
print("sqlite insert+commit median %.2f ms, max %.2f" % (statistics.median(ts), max(ts)))
