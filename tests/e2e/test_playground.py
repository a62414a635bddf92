"""The web playground in a real headless Chromium (Debian's chromium + chromedriver, driven by
selenium) against a real server of two models behind an API key: the pages open without the key
and a missing key shows the API's 401; a streamed answer is the API's greedy answer, drawn as it
streams, with TTFT and tokens/s; switching to a thinking model shows its reasoning apart; a bad
parameter shows the API's 400 and the turn can be sent again; Stop aborts the request on the
server; JSON-schema output; a forced tool call and its result sent back; the metrics page draws
its charts and agrees with prometheus_client's reading of /metrics. No script error on the way."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.browser import chromium, missing, set_value
from tests.e2e.conftest import ServerProcess
from tests.models.tiny import make_tiny_model_eos0

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(missing() is not None, reason=str(missing()))]

KEY = "playground-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# ChatML whose generation prompt opens the thinking (DeepSeek-R1's habit): the tiny random model's
# whole reply is reasoning until it writes </think>, which it does not in a few tokens
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city"],
          "properties": {"city": {"type": "string", "maxLength": 12}}}  # fmt: skip
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 8}}}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
WAIT_S = 30


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("think")
    make_tiny_model_eos0(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINK_TEMPLATE}))
    models = ["smollm2=smollm2-135m-instruct", f"think={folder}"]
    proc = ServerProcess(models, "--api-key", KEY, log_dir=folder, served_name=None).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def page(server: ServerProcess) -> Iterator:
    with chromium() as driver:
        driver.get(f"{server.url}/")
        yield driver


def wait(driver, condition, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(lambda d: condition(d), message=what)


def send(driver, text: str) -> dict:
    """Sends `text` from the composer and waits for the reply: its content, reasoning, tool calls
    and stats line, and how many times the page redrew the reply while it streamed."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.execute_script(
        "window.redraws = 0; new MutationObserver(() => window.redraws++).observe("
        "document.getElementById('messages'), {subtree: true, childList: true, characterData: true})"
    )
    driver.find_element(By.ID, "prompt").send_keys(text, Keys.ENTER)
    wait(driver, lambda d: d.execute_script("return document.body.dataset.busy") == "false", "the reply")
    return driver.execute_script("""
        const reply = [...document.querySelectorAll('.message.assistant')].at(-1);
        const error = document.getElementById('error');
        return reply === undefined ? {error: error.hidden ? null : error.textContent} : {
          content: reply.querySelector('.content').textContent,
          reasoning: reply.querySelector('.reasoning').hidden ? null : reply.querySelector('.reasoning pre').textContent,
          calls: [...reply.querySelectorAll('.tool-call')].map((c) => c.textContent),
          stats: reply.querySelector('.stats').textContent, redraws: window.redraws,
          error: error.hidden ? null : error.textContent};
    """)  # fmt: skip


def clear(driver) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "clear").click()


def api_chat(server: ServerProcess, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_pages_open_without_the_key_and_the_api_does_not(server: ServerProcess) -> None:
    for path, kind in [("/", "text/html"), ("/playground/metrics", "text/html"),
                       ("/playground/static/playground.js", "javascript")]:  # fmt: skip
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 200 and kind in r.headers["content-type"], (path, r.status_code)
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/playground/static/nothing.js", timeout=10).status_code == 404


def test_a_missing_key_shows_the_401(page) -> None:
    from selenium.webdriver.common.by import By

    banner = wait(
        page,
        lambda d: d.find_element(By.ID, "error").is_displayed() and d.find_element(By.ID, "error"),
        "401",
    )
    assert "HTTP 401" in banner.text and "API key" in banner.text
    assert page.find_elements(By.CSS_SELECTOR, "#model option") == []


def test_streamed_answer_is_the_apis_greedy_answer(page, server: ServerProcess) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    set_value(page, "api-key", KEY)  # stored, and the model list reloaded with it
    wait(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#model option")) == 2, "the model list")
    assert not page.find_element(By.ID, "error").is_displayed()
    Select(page.find_element(By.ID, "model")).select_by_value("smollm2")
    set_value(page, "temperature", "0")
    set_value(page, "max_tokens", "24")
    reply = send(page, "What is the capital of France?")
    expected = api_chat(server, model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
                        temperature=0, max_tokens=24)  # fmt: skip
    assert reply["content"] == expected["choices"][0]["message"]["content"] and reply["content"]
    assert reply["reasoning"] is None and reply["error"] is None
    assert reply["redraws"] > 3, "the answer was drawn at once, not as it streamed"
    stats = reply["stats"]
    tokens = expected["usage"]["completion_tokens"]
    assert stats.startswith("TTFT ") and " tokens/s" in stats and f"{tokens} tokens" in stats, stats
    assert float(stats.split()[1]) > 0 and f"finish: {expected['choices'][0]['finish_reason']}" in stats
    assert page.execute_script("return localStorage.getItem('llmserve.apiKey')") == KEY


def test_switching_models_shows_the_reasoning_apart(page, server: ServerProcess) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    clear(page)
    Select(page.find_element(By.ID, "model")).select_by_value("think")
    set_value(page, "max_tokens", "12")
    reply = send(page, "The quick brown fox")
    expected = api_chat(server, model="think", messages=[{"role": "user", "content": "The quick brown fox"}],
                        temperature=0, max_tokens=12)["choices"][0]["message"]  # fmt: skip
    assert reply["reasoning"] == expected["reasoning_content"] and reply["reasoning"]
    assert reply["content"] == (expected["content"] or "")
    assert page.find_element(By.CSS_SELECTOR, ".message.assistant .role").text.lower() == "think"


def test_a_bad_parameter_shows_the_apis_error(page) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    clear(page)
    Select(page.find_element(By.ID, "model")).select_by_value("smollm2")
    set_value(page, "top_p", "5")
    reply = send(page, "Hello")
    assert reply["error"] is not None and "HTTP 400" in reply["error"] and "top_p" in reply["error"], reply
    assert page.find_element(By.ID, "prompt").get_attribute("value") == "Hello"  # the turn taken back
    set_value(page, "top_p", "")
    page.find_element(By.ID, "prompt").clear()
    reply = send(page, "Hello")
    assert reply["error"] is None and reply["content"], reply  # the server kept serving
    assert len(page.find_elements(By.CSS_SELECTOR, ".message.assistant")) == 1


def test_stop_aborts_the_reply(page, server: ServerProcess) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    clear(page)
    set_value(page, "max_tokens", "1000")  # greedy (temperature 0): a story of hundreds of tokens
    aborted = aborts(server)
    page.find_element(By.ID, "prompt").send_keys("Tell me a very long story.", Keys.ENTER)
    wait(
        page,
        lambda d: d.execute_script(
            "return document.querySelector('.message.assistant .content')?.textContent"
        ),
        "the first words",
    )
    page.find_element(By.ID, "stop-button").click()
    wait(page, lambda d: d.execute_script("return document.body.dataset.busy") == "false", "the stop")
    stats = page.find_element(By.CSS_SELECTOR, ".message.assistant .stats").text
    assert stats.startswith("TTFT ") and stats.endswith("stopped"), stats
    wait(page, lambda d: aborts(server) == aborted + 1, "the server's abort")  # the request ended there too


def aborts(server: ServerProcess) -> float:
    r = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10)
    return sum(s.value for f in text_string_to_metric_families(r.text) for s in f.samples
               if s.name == "llmserve:request_success_total" and s.labels["finished_reason"] == "abort")  # fmt: skip


def test_json_schema_output(page, server: ServerProcess) -> None:
    clear(page)
    set_value(page, "max_tokens", "40")
    set_value(page, "response-format", "json_schema")
    set_value(page, "schema", json.dumps(SCHEMA))
    reply = send(page, "Which city is the capital of France?")
    jsonschema.validate(json.loads(reply["content"]), SCHEMA)
    expected = api_chat(server, model="smollm2", temperature=0, max_tokens=40,
                        messages=[{"role": "user", "content": "Which city is the capital of France?"}],
                        response_format={"type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA, "strict": True}})  # fmt: skip
    assert reply["content"] == expected["choices"][0]["message"]["content"]


def test_a_tool_call_and_its_result(page, server: ServerProcess) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    clear(page)
    set_value(page, "response-format", "text")
    set_value(page, "tools", "[{not json")
    assert send(page, "What is the weather in Paris?")["error"].startswith("tools: not valid JSON")
    assert page.find_element(By.ID, "prompt").get_attribute("value") == "What is the weather in Paris?"
    page.find_element(By.ID, "prompt").clear()
    set_value(page, "tools", json.dumps(TOOLS))
    Select(page.find_element(By.ID, "tool-choice")).select_by_value("required")
    question = "What is the weather in Paris?"
    reply = send(page, question)
    assert len(reply["calls"]) == 1 and reply["calls"][0].startswith("get_weather("), reply
    arguments = reply["calls"][0].removeprefix("get_weather(")[:-1]
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert "finish: tool_calls" in reply["stats"]

    # the result goes back as a tool message (the page switched to it) and the model answers
    call_id = page.find_element(By.CSS_SELECTOR, ".tool-call").get_attribute("data-id")
    assert call_id and Select(page.find_element(By.ID, "role")).first_selected_option.text == "as tool result"
    Select(page.find_element(By.ID, "tool-choice")).select_by_value("none")
    answer = send(page, "18 degrees and sunny")
    set_value(page, "tools", "")
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "18 degrees and sunny"},
    ]  # fmt: skip
    expected = api_chat(server, model="smollm2", messages=messages, tools=TOOLS, tool_choice="none",
                        temperature=0, max_tokens=40)["choices"][0]["message"]  # fmt: skip
    assert answer["content"] == expected["content"] and answer["content"] and answer["calls"] == [], answer
    assert (
        page.find_element(By.CSS_SELECTOR, ".message.tool .role").text.lower() == "tool result · get_weather"
    )
    assert Select(page.find_element(By.ID, "role")).first_selected_option.text == "as user"


def test_the_metrics_page_draws(page, server: ServerProcess) -> None:
    from selenium.webdriver.common.by import By

    page.get(f"{server.url}/playground/metrics")  # the key from localStorage
    charts = ["chart-requests", "chart-kv", "chart-throughput"]
    wait(page, lambda d: all(int(d.find_element(By.ID, c).get_attribute("data-points") or 0) >= 4 for c in charts),
         "the charts")  # fmt: skip
    assert not page.find_element(By.ID, "error").is_displayed()
    r = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10)
    generated = sum(s.value for f in text_string_to_metric_families(r.text) for s in f.samples
                    if s.name == "llmserve:generation_tokens_total")  # fmt: skip
    assert generated > 0
    assert page.find_element(By.ID, "tile-tokens").text == str(int(generated))
    assert page.find_element(By.ID, "tile-running").text == "0"
    # the page's parser reads every sample of /metrics as prometheus_client does
    parsed = page.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "import(new URL('static/metrics.js', location)).then((m) => done(m.parsePrometheus(arguments[0])))",
        r.text,
    )
    reference = [
        (s.name, s.labels, s.value) for f in text_string_to_metric_families(r.text) for s in f.samples
    ]
    assert [(s["name"], s["labels"], s["value"]) for s in parsed] == reference
    # two models loaded: one KV line each, and both throughput lines
    points = int(page.find_element(By.ID, "chart-kv").get_attribute("data-points"))
    assert points >= 2 * 2


def test_no_script_errors(page) -> None:
    """Nothing the pages ran threw (the console keeps the refused requests: 401, 400)."""
    logs = page.get_log("browser")
    assert any("401" in e["message"] for e in logs), logs  # the console was read
    errors = [
        e["message"] for e in logs if e["level"] == "SEVERE" and "Failed to load resource" not in e["message"]
    ]
    assert errors == [], errors
