"""What the oracle needs to know of a device: its platform and CUDA compute capability."""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """platform: "gpu" or "cpu" (or another JAX platform); capability: (major, minor) on NVIDIA GPUs."""

    platform: str
    capability: tuple[int, int] | None = None

    @property
    def sm(self) -> int | None:
        """Compute capability as an SM number (9.0 -> 90), None off NVIDIA GPUs."""
        return None if self.capability is None else 10 * self.capability[0] + self.capability[1]

    def describe(self) -> str:
        return self.platform if self.sm is None else f"SM{self.sm}"


def resolve_device(device=None):
    """``device`` (a jax Device) as it is, or for None JAX's default device: ``jax.default_device``'s
    where one is set, else the first device."""
    if device is None:
        device = jax.config.jax_default_device
        if isinstance(device, str):
            device = jax.devices(device)[0]
        elif device is None:
            device = jax.devices()[0]
    return device


def device_kind(device=None) -> str:
    """The device's model name (``jax.Device.device_kind``, e.g. ``"NVIDIA H100 80GB HBM3"``) of
    ``device`` or JAX's default device (:func:`resolve_device`)."""
    return str(resolve_device(device).device_kind)


def device_info(device=None) -> DeviceInfo:
    """``device``: a DeviceInfo (returned as is), a jax Device, or None for JAX's default device
    (:func:`resolve_device`)."""
    if isinstance(device, DeviceInfo):
        return device
    device = resolve_device(device)
    cap = getattr(device, "compute_capability", None)
    capability = None
    if device.platform == "gpu" and cap:
        major, minor = str(cap).split(".")[:2]
        capability = (int(major), int(minor))
    return DeviceInfo(device.platform, capability)


def sm90_refusal(device=None) -> str | None:
    """Why an ``sm_90a`` kernel cannot run on ``device`` (None: it is SM90): a device that is not
    an NVIDIA GPU (a CPU) is named as such, whatever the build compiled."""
    dev = device_info(device)
    if dev.sm is None:
        return f"needs an NVIDIA SM90 GPU (Hopper); this device is {dev.describe()}"
    if dev.sm != 90:
        return f"needs SM90 (this build compiles sm_90a only); this device is {dev.describe()}"
    return None


def sm90_module_ready(module, error: str | None, device=None) -> tuple[bool, str]:
    """Whether a native module built for ``sm_90a`` only can run on ``device``: (False, why) when
    the device is not SM90 (:func:`sm90_refusal`) or the module did not load (``error`` says why);
    (True, "") otherwise."""
    why = sm90_refusal(device)
    if why:
        return False, why
    if module is None:
        return False, error or "the native module is not loaded"
    return True, ""
