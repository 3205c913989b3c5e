"""A sign estimator and a plain policy-gradient loss, following the kernel's
contracts. Their settings models hold the only defaults: the kernel passes
every field as a keyword, so the functions declare them without defaults.
The shared algorithm knobs arrive as one object, ``knobs``. ``old_pg`` is a
loss written for the convention before ``knobs`` (every knob a keyword),
which the kernel still serves, with a DeprecationWarning."""
from pydantic import BaseModel, ConfigDict, Field


class SignSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scale: float = Field(1.0, gt=0)


class VanillaPGSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pg_coef: float = 1.0


def sign_advantages(rewards, group_ids, *, loss_masks, knobs, scale, **kwargs):
    groups = {}
    for r, g in zip(rewards, group_ids):
        groups.setdefault(g, []).append(r)
    means = {g: sum(v) / len(v) for g, v in groups.items()}
    out = []
    for r, g in zip(rewards, group_ids):
        d = r - means[g]
        out.append(scale * (1.0 if d > 0 else (-1.0 if d < 0 else 0.0)))
    return out  # one value per trajectory: the kernel broadcasts it to the loss tokens


def vanilla_pg(logprobs, data, *, entropy=None, knobs, pg_coef, **kwargs):
    mask = data["loss_mask"]
    norm = data.get("batch_loss_tokens", mask.sum())
    loss = -(pg_coef * data["advantages"] * logprobs * mask).sum() / norm
    return loss, {"vanilla_pg_loss": loss.detach()}


def old_pg(logprobs, data, *, entropy=None, eps_clip, pg_coef, **kwargs):
    # eps_clip: a shared knob taken as a keyword (the old convention); it scales nothing here,
    # it is reported (as a token mean, so that micro-batch shares add up) for a test to see which value arrived.
    mask = data["loss_mask"]
    norm = data.get("batch_loss_tokens", mask.sum())
    loss = -(pg_coef * data["advantages"] * logprobs * mask).sum() / norm
    return loss, {"old_pg_loss": loss.detach(), "old_pg_eps_clip": eps_clip * mask.sum() / norm}
