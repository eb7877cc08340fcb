-- Provider accounts (a projection): what a provider pool's machines are created with. The
-- account's secrets are not here: `secret_ref` names them in `sealed_secrets`.

CREATE TABLE provider_accounts (
    id         text PRIMARY KEY,
    name       text NOT NULL UNIQUE,
    provider   text NOT NULL,
    config     jsonb NOT NULL,
    secret_ref text,
    last_error jsonb,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    version    bigint NOT NULL
);
