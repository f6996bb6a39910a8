"""Checks Airlock's public API contract with third-party clients; driven by api_contract.rs.

    api_contract.py reflection <grpc target>
        grpcio-reflection's client (reflection v1alpha) lists the services and resolves
        each one's descriptor; a raw v1 ListServices through grpcio checks v1 too.
    api_contract.py openapi <http url> <token>
        /openapi.json passes openapi-spec-validator as OpenAPI 3.1.
    api_contract.py strict <http url> <token> <echo port>
        Every tool of /v1/tools?format=openai&strict=true is already strict for the
        openai and openai-agents packages, then strict-style calls (null optionals, maps
        as pairs) run through /v1/tool_calls.

Each mode prints one JSON object on stdout; failures raise, with a message, and exit 1.
"""

import copy
import json
import sys
import urllib.request


def http_json(url, token, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    request.add_header("Authorization", f"Bearer {token}")
    if body is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def reflection(target):
    import grpc
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha import reflection_pb2
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    # grpcio sends a unix: target's socket path as :authority, which the h2 server
    # refuses as malformed (RST_STREAM PROTOCOL_ERROR); name a host instead, as grpcurl does.
    options = [("grpc.default_authority", "localhost")] if target.startswith("unix:") else []
    with grpc.insecure_channel(target, options=options) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        v1alpha = sorted(database.get_services())
        pool = DescriptorPool(database)
        methods = {}
        for service in v1alpha:
            descriptor = pool.FindServiceByName(service)
            methods[service] = sorted(m.name for m in descriptor.methods)
        # grpcio-reflection ships only the v1alpha stubs; v1's messages are the same on
        # the wire, so its method is called with them.
        info = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        responses = info(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30)
        v1 = sorted(s.name for r in responses for s in r.list_services_response.service)
    return {"v1alpha": v1alpha, "v1": v1, "methods": methods}


def openapi(url, token):
    from openapi_spec_validator import OpenAPIV31SpecValidator

    document = http_json(f"{url}/openapi.json", token)
    errors = [str(e.message) for e in OpenAPIV31SpecValidator(document).iter_errors()]
    if errors:
        raise SystemExit("openapi-spec-validator: " + "; ".join(errors[:20]))
    paths = {path: sorted(item.keys()) for path, item in document["paths"].items()}
    return {"openapi": document["openapi"], "paths": paths}


# OpenAI's documented strict-mode subset of JSON Schema: anything else is refused.
STRICT_KEYWORDS = {
    "type", "description", "title", "enum", "const", "properties", "required",
    "additionalProperties", "items", "anyOf", "$ref", "$defs", "pattern", "format",
    "multipleOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "minItems", "maxItems",
}


def check_subset(name, schema, at="#"):
    unknown = set(schema) - STRICT_KEYWORDS
    if unknown:
        raise SystemExit(f"{name}: {at} uses {sorted(unknown)}, outside strict mode's subset")
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    if "object" in types:
        if schema.get("additionalProperties") is not False:
            raise SystemExit(f"{name}: {at} is an object without additionalProperties: false")
        if sorted(schema.get("required", [])) != sorted(schema.get("properties", {})):
            raise SystemExit(f"{name}: {at} does not list every property in required")
    for key, sub in schema.get("properties", {}).items():
        check_subset(name, sub, f"{at}/properties/{key}")
    if isinstance(schema.get("items"), dict):
        check_subset(name, schema["items"], f"{at}/items")
    for i, sub in enumerate(schema.get("anyOf", [])):
        check_subset(name, sub, f"{at}/anyOf/{i}")
    for key, sub in schema.get("$defs", {}).items():
        check_subset(name, sub, f"{at}/$defs/{key}")


def strict_checks(tools):
    from agents import FunctionTool
    from agents.models.chatcmpl_converter import Converter
    from agents.strict_schema import ensure_strict_json_schema
    from openai.lib._pydantic import _ensure_strict_json_schema
    from openai.types.chat import ChatCompletionFunctionToolParam
    from pydantic import TypeAdapter

    shape = TypeAdapter(ChatCompletionFunctionToolParam)
    checked = []
    for tool in tools:
        shape.validate_python(tool)
        function = tool["function"]
        name = function["name"]
        if function.get("strict") is not True:
            raise SystemExit(f"{name}: listed without strict: true: {json.dumps(tool)}")
        schema = function["parameters"]
        # A schema already strict is a fixed point of each package's strict conversion.
        for label, convert in [
            ("agents.strict_schema.ensure_strict_json_schema", lambda s: ensure_strict_json_schema(s)),
            (
                "agents ensure_strict_json_schema(_reject_open_objects=True)",
                lambda s: ensure_strict_json_schema(s, _reject_open_objects=True),
            ),
            ("openai.lib._pydantic._ensure_strict_json_schema", lambda s: _ensure_strict_json_schema(s, path=(), root=s)),
        ]:
            converted = convert(copy.deepcopy(schema))
            if converted != schema:
                raise SystemExit(
                    f"{name}: {label} changed the schema, so it was not strict:\n"
                    f"served:    {json.dumps(schema, sort_keys=True)}\nconverted: {json.dumps(converted, sort_keys=True)}"
                )
        check_subset(name, schema)

        async def never(ctx, args):
            raise AssertionError("not invoked")

        agent_tool = FunctionTool(
            name=name,
            description=function["description"],
            params_json_schema=copy.deepcopy(schema),
            on_invoke_tool=never,
            strict_json_schema=True,
        )
        if Converter.tool_to_openai(agent_tool) != tool:
            raise SystemExit(f"{name}: openai-agents would send a different strict tool than the one served")
        checked.append(name)
    return checked


def strict(url, token, echo_port):
    import jsonschema

    tools = http_json(f"{url}/v1/tools?format=openai&strict=true", token)["tools"]
    checked = strict_checks(tools)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    database = schemas["query_database"]["properties"]["database"].get("enum", ["demo"])[0]

    # What a strict model emits: every property present, null where it has nothing to say.
    calls = [
        ("write", "write_file", {"path": "notes/a.txt", "content": "one\ntwo\nthree\n"}),
        ("read_all", "read_file", {"path": "notes/a.txt", "offset": None, "limit": None}),
        ("read_from_2", "read_file", {"path": "notes/a.txt", "offset": 2, "limit": None}),
        ("edit", "edit_file", {
            "path": "notes/a.txt",
            "edits": [{"old_text": "two", "new_text": "2", "replace_all": None}],
            "dry_run": None,
        }),
        ("list", "list_directory", {"path": "notes", "recursive": None, "max_entries": None}),
        ("shell_env", "execute_shell", {
            "command": "printf '%s|' \"$LANG\"; pwd",
            "argv": None, "cwd": None, "stdin": None,
            "env": [{"name": "LANG", "value": "C.UTF-8"}],
            "timeout_seconds": None,
        }),
        ("shell_argv", "execute_shell", {
            "command": None, "argv": ["cat"], "cwd": "notes", "stdin": "via stdin",
            "env": None, "timeout_seconds": None,
        }),
        ("shell_neither", "execute_shell", {
            "command": None, "argv": None, "cwd": None, "stdin": None, "env": None,
            "timeout_seconds": None,
        }),
        ("http", "http_request", {
            "method": "GET", "url": f"http://127.0.0.1:{echo_port}/echo",
            "headers": [{"name": "X-Airlock-Strict", "value": "yes"}],
            "body": None, "timeout_seconds": None, "max_response_bytes": None,
        }),
        ("query", "query_database", {"database": database, "sql": "SELECT 1 AS one", "params": None, "max_rows": None}),
    ]
    results = {}
    for label, name, arguments in calls:
        jsonschema.Draft202012Validator(schemas[name]).validate(arguments)
        body = {
            "session_id": "strict-e2e",
            "tool_calls": [{
                "id": f"call_{label}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }],
        }
        response = http_json(f"{url}/v1/tool_calls", token, body)
        results[label] = {
            "status": response["calls"][0]["status"],
            "content": response["messages"][0]["content"] if response["messages"] else None,
        }
    return {"checked": checked, "results": results}


def main():
    mode = sys.argv[1]
    if mode == "reflection":
        out = reflection(sys.argv[2])
    elif mode == "openapi":
        out = openapi(sys.argv[2], sys.argv[3])
    elif mode == "strict":
        out = strict(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
