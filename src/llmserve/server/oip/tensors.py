"""Open Inference Protocol v2 messages <-> llmserve's request types, for text generation as
KServe's Hugging Face runtime shapes it:

    ModelInferRequest                              llmserve
      model_name                                   `model` (routed by ModelManager, "" = default)
      inputs["text_input"]  BYTES, one element     the prompt (UTF-8)
      parameters{max_tokens, temperature, ...}     the same fields as /v1/completions
    ModelInferResponse
      outputs["text_output"] BYTES, one element    the text (streamed: the text since the last response)
      parameters{finish_reason, num_*_tokens}      on the last response

The request becomes a `CompletionRequest`, so the fields are checked by the same pydantic model,
caps and `SamplingParams` as HTTP's; every error is an `APIError` naming the field at fault
(`text_input`, `parameters.<name>`), which service.py turns into a gRPC status. Nothing here
knows about grpc itself, only the generated messages.
"""

from __future__ import annotations

import struct

from pydantic import ValidationError

from llmserve.server.errors import APIError
from llmserve.server.oip import inference_pb2 as pb
from llmserve.server.protocol import CompletionRequest
from llmserve.server.serving.pieces import End

TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"

PARAMETERS = frozenset({
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
})  # fmt: skip
"""The request parameters taken (as /v1/completions' fields of the same names); others are refused."""


def parameter_value(p: pb.InferParameter) -> bool | int | float | str:
    """An `InferParameter`'s value, whichever of its kinds it holds."""
    kind = p.WhichOneof("parameter_choice")
    if kind is None:
        raise ValueError("holds no value")
    return getattr(p, kind)


def _prompt(request: pb.ModelInferRequest) -> str:
    """The one string in `text_input`: from `contents.bytes_contents` or, in the raw form, from
    `raw_input_contents` (each element a 4-byte little-endian length, then its bytes)."""
    names = [t.name for t in request.inputs]
    if TEXT_INPUT not in names:
        raise APIError(400, f"the request needs a BYTES input tensor named {TEXT_INPUT!r}; got "
                       f"{names or 'no inputs'}", param=TEXT_INPUT)  # fmt: skip
    extra = [n for n in names if n != TEXT_INPUT]
    if extra or len(names) > 1:
        raise APIError(400, f"unexpected input tensors {extra or names}; the model takes only "
                       f"{TEXT_INPUT!r}", param="inputs")  # fmt: skip
    index = names.index(TEXT_INPUT)
    tensor = request.inputs[index]
    if tensor.datatype != "BYTES":
        raise APIError(
            400, f"{TEXT_INPUT} must have datatype BYTES; got {tensor.datatype!r}", param=TEXT_INPUT
        )
    if request.raw_input_contents:
        if len(request.raw_input_contents) != len(request.inputs):
            raise APIError(
                400, "raw_input_contents must have one entry per input", param="raw_input_contents"
            )
        elements = _unpack_bytes(request.raw_input_contents[index])
    else:
        elements = list(tensor.contents.bytes_contents)
    num_elements = 1
    for dim in tensor.shape:
        num_elements *= dim
    if len(elements) != 1 or num_elements != 1:
        raise APIError(400, f"{TEXT_INPUT} must hold exactly one string (shape [1]); got {len(elements)} "
                       f"element(s) and shape {list(tensor.shape)}", param=TEXT_INPUT)  # fmt: skip
    try:
        return elements[0].decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, f"{TEXT_INPUT} must be UTF-8 text", param=TEXT_INPUT) from None


def _unpack_bytes(raw: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise APIError(400, f"raw {TEXT_INPUT} is cut inside a length prefix", param=TEXT_INPUT)
        (n,) = struct.unpack_from("<I", raw, at)
        out.append(raw[at + 4 : at + 4 + n])
        at += 4 + n
        if at > len(raw):
            raise APIError(400, f"raw {TEXT_INPUT} is shorter than its length prefix says", param=TEXT_INPUT)
    return out


STREAM = "stream"


def stream_flag(request: pb.ModelInferRequest) -> bool:
    """ModelStreamInfer's parameter `stream` (Triton's: deltas when true, the default, else one
    whole answer), taken out of the request's parameters."""
    if STREAM not in request.parameters:
        return True
    p = request.parameters[STREAM]
    if p.WhichOneof("parameter_choice") != "bool_param":
        raise APIError(400, f"parameters.{STREAM} must be a bool_param", param=f"parameters.{STREAM}")
    stream = p.bool_param
    del request.parameters[STREAM]
    return stream


def completion_request(request: pb.ModelInferRequest) -> CompletionRequest:
    """The /v1/completions request a `ModelInferRequest` means (400s name the field at fault)."""
    prompt = _prompt(request)
    for out in request.outputs:
        if out.name != TEXT_OUTPUT:
            raise APIError(400, f"unknown output {out.name!r}; the model gives only {TEXT_OUTPUT!r}",
                           param="outputs")  # fmt: skip
    fields: dict[str, object] = {}
    for name, p in request.parameters.items():
        if name not in PARAMETERS:
            raise APIError(400, f"unknown parameter {name!r}; the parameters are {', '.join(sorted(PARAMETERS))}",
                           param=f"parameters.{name}")  # fmt: skip
        try:
            fields[name] = parameter_value(p)
        except ValueError as e:
            raise APIError(400, f"parameters.{name} {e}", param=f"parameters.{name}") from None
    try:
        return CompletionRequest(model=request.model_name or None, prompt=prompt, **fields)  # type: ignore[arg-type]
    except ValidationError as e:
        err = e.errors()[0]
        name = ".".join(str(x) for x in err["loc"][:1])
        raise APIError(400, f"parameters.{name}: {err['msg']}", param=f"parameters.{name}") from None


def _bytes_output(text: str) -> pb.ModelInferResponse.InferOutputTensor:
    out = pb.ModelInferResponse.InferOutputTensor(name=TEXT_OUTPUT, datatype="BYTES", shape=[1])
    out.contents.bytes_contents.append(text.encode("utf-8"))
    return out


def infer_response(model: str, request_id: str, text: str, end: End | None) -> pb.ModelInferResponse:
    """A response carrying `text` (the whole answer, or a streamed delta); `end`: the last response's
    finish reason and token counts, as response parameters."""
    response = pb.ModelInferResponse(model_name=model, id=request_id, outputs=[_bytes_output(text)])
    if end is not None:
        params = response.parameters
        params["finish_reason"].string_param = end.reason or ""
        params["num_prompt_tokens"].int64_param = end.prompt_eval_count
        params["num_output_tokens"].int64_param = end.eval_count
    return response


def model_metadata(name: str, platform: str) -> pb.ModelMetadataResponse:
    """What a text-generation model takes and gives (KServe's Hugging Face runtime's tensors)."""
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=name, platform=platform,
        inputs=[tensor(name=TEXT_INPUT, datatype="BYTES", shape=[1])],
        outputs=[tensor(name=TEXT_OUTPUT, datatype="BYTES", shape=[1])],
    )  # fmt: skip
