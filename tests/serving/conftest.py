import pytest
import torch

from serving.tiny import build_tiny_lora_adapter, build_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "v000001": build_tiny_lora_adapter(tiny_model, root / "v000001", seed=1),
        "v000002": build_tiny_lora_adapter(tiny_model, root / "v000002", seed=2),
    }


@pytest.fixture
def engine_server(tiny_model):
    from serving.local_engine import LocalEngine
    from serving.http import serve

    server = serve(LocalEngine(tiny_model, max_total_tokens=8192, torch_threads=1), port=0)
    yield server
    server.shutdown()


def sessions_at_once(client, n: int, prompt, **kwargs) -> dict[str, dict]:
    """``n`` calls ``client.generate(prompt(i), ..., session_id=f"s{i}")`` at once, each from a thread
    of its own; their answers by session id. A call's error fails the test, with every other."""
    import threading

    answers: dict[str, dict] = {}
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            answers[f"s{i}"] = client.generate(prompt(i), {"max_new_tokens": 3, "ignore_eos": True},
                                               session_id=f"s{i}", **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported below, with the others
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return answers
