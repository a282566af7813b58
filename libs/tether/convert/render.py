"""The render pair of the Work stream, both halves in one place: the orchestrator sends a
`RenderJob` as a WorkRender, the worker answers with a `Rendered` as a WorkRendered. The request
travels as JSON text, so its integers stay integers."""

from __future__ import annotations

import json

from tether.convert.configs import config_from_proto, config_to_proto
from tether.domain import FoundDocument, Rendered, RenderJob
from tether.v1 import orchestrator_pb2


def render_job_to_proto(job: RenderJob) -> orchestrator_pb2.WorkRender:
    """A render job as the orchestrator pushes it."""
    return orchestrator_pb2.WorkRender(
        render_id=job.render_id,
        tenant_id=job.tenant_id,
        config=config_to_proto(job.config),
        message=job.message,
        source=job.source,
        channel=job.channel,
        actor_type=job.actor_type,
        actor_id=job.actor_id,
        documents=[
            orchestrator_pb2.RetrievedDocument(
                document_id=d.document_id, title=d.title, text=d.text
            )
            for d in job.documents
        ],
    )


def render_job_from_proto(message: orchestrator_pb2.WorkRender) -> RenderJob:
    """A pushed render job, as the worker builds it."""
    return RenderJob(
        render_id=message.render_id,
        tenant_id=message.tenant_id,
        config=config_from_proto(message.config),
        message=message.message,
        source=message.source,
        channel=message.channel,
        actor_type=message.actor_type,
        actor_id=message.actor_id,
        documents=tuple(FoundDocument(d.document_id, d.title, d.text) for d in message.documents),
    )


def rendered_to_proto(rendered: Rendered) -> orchestrator_pb2.WorkRendered:
    """A worker's answer to a render job."""
    return orchestrator_pb2.WorkRendered(
        render_id=rendered.render_id,
        request_json=json.dumps(rendered.request, ensure_ascii=False) if rendered.request else "",
        estimated_input_tokens=rendered.estimated_input_tokens,
        estimated_cost_micros=rendered.estimated_cost_micros,
        error_code=rendered.error_code,
        error_message=rendered.error_message,
        warnings=rendered.warnings,
    )


def rendered_from_proto(message: orchestrator_pb2.WorkRendered) -> Rendered:
    """A worker's answer, as the orchestrator reads it."""
    return Rendered(
        render_id=message.render_id,
        request=json.loads(message.request_json) if message.request_json else {},
        estimated_input_tokens=message.estimated_input_tokens,
        estimated_cost_micros=message.estimated_cost_micros,
        error_code=message.error_code,
        error_message=message.error_message,
        warnings=tuple(message.warnings),
    )
