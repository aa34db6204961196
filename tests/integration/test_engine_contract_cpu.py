"""The engine contract against the embedded CPU engine (smallest model, NGRAM), started as the replica starts it."""

import pytest

from serve.engines.base import ReplicaConfig
from serve.replica.deployment import EngineProcess
from serve.spec import NgramSpec
from tests.engine_contract import EngineContract

pytestmark = pytest.mark.integration


class TestCpuEngineContract(EngineContract):
    @pytest.fixture(scope="class")
    def engine(self, tmp_path_factory):
        process = EngineProcess(ReplicaConfig(model="smollm2-135m", spec=NgramSpec(num_draft_tokens=4, max_bfs_breadth=2),
                                              log_dir=str(tmp_path_factory.mktemp("engine"))))
        try:
            process.wait_ready()
            yield process
        finally:
            process.stop()
