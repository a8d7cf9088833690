"""The README's quickstart, walked as written against the shared server: its Python snippets and its curl line,
read from README.md itself so that they cannot drift, with only the URL's port and the key replaced."""
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import SMOLLM2_KEY

ROOT = Path(__file__).parents[1]
README_ADDRESS = re.compile(r"(localhost|127\.0\.0\.1):8000\b")
README_KEY = "sk-inferd-..."


def quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", quickstart(), re.S | re.M)


def for_server(snippet: str, url: str) -> str:
    """The snippet with the test server's address and key in place of the README's."""
    assert README_ADDRESS.search(snippet) and README_KEY in snippet, snippet
    return README_ADDRESS.sub(url.removeprefix("http://"), snippet).replace(README_KEY, SMOLLM2_KEY)


def run_python(snippet: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def url(smollm2_server):
    return smollm2_server[0]


def test_the_quickstart_has_what_this_module_runs():
    assert len(blocks("python")) == 4 and len([b for b in blocks("sh") if b.startswith("curl ")]) == 1
    assert "pip install openai" in quickstart() and "pip install anthropic" in quickstart()


def test_the_openai_snippet(url):
    snippet = blocks("python")[0]
    lines = run_python(for_server(snippet, url))
    expected = re.findall(r"^print\(.*\)  # (\S+)$", snippet, re.M)  # what the README says a print prints
    assert expected == ["384"] and lines[-1:] == expected, lines
    assert any(line.strip() for line in lines[:-1]), lines  # the model's reply


def test_the_tool_call_snippet(url):
    lines = run_python(for_server(blocks("python")[1], url))
    assert lines[0] == "get_weather", lines
    assert isinstance(json.loads("\n".join(lines[1:]))["city"], str), lines  # the model may indent its JSON


def test_the_anthropic_snippet(url):
    lines = run_python(for_server(blocks("python")[2], url))
    assert any(line.strip() for line in lines), lines  # the model's reply


def test_the_robot_snippet(url):
    lines = run_python(for_server(blocks("python")[3], url))
    assert len(lines) == 1 and re.fullmatch(r".+ -> (reached|missed)", lines[0]), lines


def test_the_curl_line(url):
    command = next(b for b in blocks("sh") if b.startswith("curl ")).replace("\\\n", " ")
    command = for_server(command, url)
    if shutil.which("curl"):
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
    else:  # the same request, read from the command's flags
        answer = json.loads(curl_by_httpx(command))
    assert answer["model"] == "iris-classifier" and answer["predictions"] == ["setosa"], answer


def curl_by_httpx(command: str) -> str:
    args, headers, data, target = iter(shlex.split(command)[1:]), {}, None, None
    for arg in args:
        if arg == "-H":
            name, value = next(args).split(":", 1)
            headers[name] = value.strip()
        elif arg == "-d":
            data = next(args)
        elif not arg.startswith("-"):
            target = arg
    return httpx.request("POST" if data is not None else "GET", f"http://{target}", headers=headers,
                         content=data, timeout=60).text
