"""`spec.rendezvous`: the rendezvous-store pod's image and resources, parsed and checked once at the edge, and the
operator's own store image. Pure.

The store pod (rdzv.py) runs the store image (store/Dockerfile: `python -m ddp_store`, torch's TCPStore protocol with
no torch), not the trainer's: a pull of a few tens of MB, and requests and limits of its own, so that a namespace whose
ResourceQuota requires limits admits it. The image is `spec.rendezvous.image`, else the operator's
(`--store-image`, DDP_OPERATOR_STORE_IMAGE, the chart's storeImage): an operator setting the shell puts into every job
it parses (jobs.py), as it does the diagnostics tools image, so the renderers stay pure.

Resources merge per resource with DEFAULTS["rendezvous"]["resources"]: a resource the job names replaces the default's,
a defaulted request never exceeds the job's limit (it is lowered to it) and a defaulted limit never falls below the
job's request (it is raised to it), so only what the job itself says can conflict. The CRD checks what it can at
admission (the image's form, each quantity's form, the resource names); the rest (a request above its limit, a zero
limit) is a SpecError: condition InvalidSpec and a Warning Event, never an exception in a pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Mapping

from ddp_operator import __version__, crd
from ddp_operator.spec_fields import SpecError, section

# The store image when the operator is told none (it runs outside the cluster): the image `make images` builds.
DEFAULT_STORE_IMAGE = f"localhost/ddp-store:{__version__}"
STORE_PULL_POLICY = "IfNotPresent"

_SUFFIXES = {
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1), "k": Decimal("1e3"),
    "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"), "P": Decimal("1e15"), "E": Decimal("1e18"),
}
_QUANTITY = re.compile(r"^\+?([0-9]+(?:\.[0-9]*)?|\.[0-9]+)((?:[KMGTPE]i)|[numkMGTPE]|[eE][+-]?[0-9]+(?:\.[0-9]*)?)?$")


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes quantity ("50m", "64Mi", "1", 2, "1e3") as a number, or None when it is not one (or negative)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    m = _QUANTITY.match(str(value))
    if not m:
        return None
    number, suffix = Decimal(m.group(1)), m.group(2) or ""
    try:
        if suffix[:1] in ("e", "E"):
            return number * Decimal(10) ** Decimal(suffix[1:])
        return number * _SUFFIXES[suffix]
    except (InvalidOperation, ArithmeticError):
        return None


@dataclass(frozen=True)
class Rendezvous:
    """spec.rendezvous, and the operator's store image."""
    image: str | None = None  # as the job names it; None: default_image
    resources: Mapping[str, Mapping[str, Any]] = field(
        default_factory=lambda: {k: dict(v) for k, v in crd.DEFAULTS["rendezvous"]["resources"].items()})
    default_image: str = DEFAULT_STORE_IMAGE  # the operator's (--store-image), put in by the shell

    @property
    def store_image(self) -> str:
        return self.image or self.default_image


def valid_image(value: Any) -> bool:
    """An image reference as the container runtime reads one (crd.IMAGE_PATTERN)."""
    return isinstance(value, str) and len(value) <= crd.IMAGE_MAX_LENGTH and bool(re.match(crd.IMAGE_PATTERN, value))


def _image(value: Any) -> str | None:
    if value is None:
        return None
    if not valid_image(value):
        raise SpecError("spec.rendezvous.image", f"must be an image reference such as "
                                                 f"registry.example/ddp-store:0.1.0, got {value!r}")
    return value


def _quantities(resources: Mapping, kind: str) -> dict[str, Decimal]:
    """resources.<kind> as numbers, each checked; the values as written are kept by the caller."""
    given = section(resources, kind, f"spec.rendezvous.resources.{kind}")
    out = {}
    for name, value in given.items():
        path = f"spec.rendezvous.resources.{kind}.{name}"
        if name not in crd.STORE_RESOURCE_NAMES:
            raise SpecError(path, f"the store pod takes only {', '.join(crd.STORE_RESOURCE_NAMES)} (it needs no "
                                  f"device)")
        number = quantity(value)
        if number is None:
            raise SpecError(path, f'must be a quantity such as "50m", "1" or "64Mi", got {value!r}')
        if kind == "limits" and number <= 0:
            raise SpecError(path, f"must be more than 0, got {value!r}")
        out[name] = number
    return out


def parse_rendezvous(spec_section: Mapping[str, Any]) -> Rendezvous:
    """spec.rendezvous (`spec_section`, {} when absent); raises SpecError naming the field."""
    image = _image(spec_section.get("image"))
    given = section(spec_section, "resources", "spec.rendezvous.resources")
    defaults = crd.DEFAULTS["rendezvous"]["resources"]
    requests, limits = _quantities(given, "requests"), _quantities(given, "limits")
    raw = {kind: dict(section(given, kind)) for kind in ("requests", "limits")}
    out: dict[str, dict[str, Any]] = {"requests": {}, "limits": {}}
    for name in crd.STORE_RESOURCE_NAMES:
        request, limit = requests.get(name), limits.get(name)
        if request is not None and limit is not None and request > limit:
            raise SpecError(f"spec.rendezvous.resources.requests.{name}",
                            f"must be <= limits.{name} ({raw['requests'][name]} > {raw['limits'][name]})")
        default_request, default_limit = defaults["requests"].get(name), defaults["limits"].get(name)
        if limit is not None:
            out["limits"][name] = raw["limits"][name]
        elif default_limit is not None:
            # a defaulted limit below the job's request is raised to it
            out["limits"][name] = (raw["requests"][name] if request is not None and request > quantity(default_limit)
                                   else default_limit)
        if request is not None:
            out["requests"][name] = raw["requests"][name]
        elif default_request is not None:
            # a defaulted request above the job's limit is lowered to it
            out["requests"][name] = (raw["limits"][name] if limit is not None and quantity(default_request) > limit
                                     else default_request)
    return Rendezvous(image=image, resources={k: v for k, v in out.items() if v})
