"""The admin contract: how a caller shows the admin key, named once for every layer.

tritonserver's restricted APIs (`--http-restricted-api` / `--grpc-restricted-protocol`), the
front door and the HTTP API's weight routes take the key in `ADMIN_HEADER`; over gRPC Triton
expects the header with `GRPC_RESTRICTED_PREFIX` (`GRPC_ADMIN_HEADER`). The generate model's
control requests carry it as the request parameter `ADMIN_KEY_PARAMETER`, which the front door
admits beside the inputs.

Wrong keys are limited per source address on every path that checks one: the front door's
header check, and the generate model's control requests (which the HTTP API's weight routes
send). Past `WRONG_KEYS_PER_MINUTE` wrong keys in a minute from one address, that address's keyed
requests are refused, the right key included, until the minute has passed. The model learns a
control request's source from the request parameter `CLIENT_ADDRESS_PARAMETER`: the front door
sets it as a gRPC header that tritonserver forwards as a parameter (after the request's own, so
the door's value wins), and the HTTP API sets it for the client it serves.
"""

from __future__ import annotations

ADMIN_HEADER = "triton-admin-key"
GRPC_RESTRICTED_PREFIX = "triton-grpc-protocol-"
GRPC_ADMIN_HEADER = GRPC_RESTRICTED_PREFIX + ADMIN_HEADER
ADMIN_KEY_PARAMETER = "admin_key"
CLIENT_ADDRESS_PARAMETER = "triton-client-address"
WRONG_KEYS_PER_MINUTE = 10
WRONG_KEY = "wrong admin key"
TOO_MANY_WRONG_KEYS = "too many wrong admin keys from this address"
