"""The admin contract: how a caller shows the admin key, named once for every layer.

tritonserver's restricted APIs (`--http-restricted-api` / `--grpc-restricted-protocol`), the
front door and the HTTP API's weight routes take the key in `ADMIN_HEADER`; over gRPC Triton
expects the header with `GRPC_RESTRICTED_PREFIX` (`GRPC_ADMIN_HEADER`). The generate model's
control requests carry it as the request parameter `ADMIN_KEY_PARAMETER`, which the front door
admits beside the inputs.
"""

from __future__ import annotations

ADMIN_HEADER = "triton-admin-key"
GRPC_RESTRICTED_PREFIX = "triton-grpc-protocol-"
GRPC_ADMIN_HEADER = GRPC_RESTRICTED_PREFIX + ADMIN_HEADER
ADMIN_KEY_PARAMETER = "admin_key"
