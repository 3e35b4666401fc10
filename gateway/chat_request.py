"""A chat request's template options → the prompt text: ``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs`` (e.g. Qwen3's ``enable_thinking``), ``documents`` (retrieval templates'), and ``tools`` —
given to the template as transformers and vLLM give them. ``tool_choice`` "auto" (the default with tools) has the
answer's tool calls read (gateway/chat_answer.py) where the server has a ``--tool-call-parser``, and is refused
without one rather than answered without ``tool_calls``; "none" shows the model the tools and answers its text;
"required" and a named function, which need decoding constrained to the call's markup, are refused."""

from __future__ import annotations

import json
from typing import Any

from gateway.body_fields import flag
from gateway.errors import bad_request
from tandem.chat_template import ChatTemplate, ChatTemplateError

# Variables the request's chat_template_kwargs may not replace: they come from the request's own fields.
_RESERVED = {"messages", "add_generation_prompt", "continue_final_message", "tools", "documents", "bos_token",
             "eos_token"}


def render_chat(template: ChatTemplate, body: dict, messages: list[dict], reads_tool_calls: bool = False) -> str:
    """``reads_tool_calls``: the server reads tool calls out of answers (--tool-call-parser)."""
    continue_final = flag(body, "continue_final_message", False)
    add_prompt = flag(body, "add_generation_prompt", not continue_final)
    if continue_final and add_prompt:  # (vLLM refuses it too; named here, not as the template's error on messages)
        raise bad_request("continue_final_message", "and add_generation_prompt exclude each other: set "
                                                    "add_generation_prompt to false to continue the last message")
    extra = dict(_template_kwargs(body))
    tools = _tools(body, reads_tool_calls)
    if tools is not None:
        extra["tools"] = tools
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
            raise bad_request("documents", "must be a list of objects (each a document's fields, as title and text)")
        extra["documents"] = documents
    try:
        return template.render(messages, add_generation_prompt=add_prompt, continue_final_message=continue_final,
                               **extra)
    except ChatTemplateError as e:
        raise bad_request("messages", str(e)) from e




def _template_kwargs(body: dict) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs", "must be an object of template variables")
    reserved = sorted(set(kwargs) & _RESERVED)
    if reserved:
        raise bad_request("chat_template_kwargs", f"{', '.join(reserved)}: set by the request's own fields")
    return kwargs


def tool_calls_asked(body: dict) -> bool:
    """Whether the answer may call the request's tools (tool_choice auto, the default where tools are given)."""
    return bool(body.get("tools")) and body.get("tool_choice") in (None, "auto")


def _tools(body: dict, reads_tool_calls: bool) -> list[dict] | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            what = f"is {json.dumps(choice)[:40]}" if isinstance(choice, str) else "names a tool"
            raise bad_request("tool_choice", f"{what} but the request has no tools")
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad_request("tools", "must be a list of tool objects")
    if choice in (None, "auto") and not reads_tool_calls:
        raise bad_request("tool_choice", "this server reads no tool calls out of the model's text (start it with "
                                         "--tool-call-parser NAME for that): send tool_choice \"none\" to show the "
                                         "model the tools and get its text")
    if choice not in (None, "auto", "none"):
        what = f"{json.dumps(choice)[:40]}" if isinstance(choice, str) else "a named function"
        raise bad_request("tool_choice", f"{what} needs decoding constrained to a call's markup, which this server "
                                         "does not do: send \"auto\" (the model chooses) or \"none\"")
    return tools
