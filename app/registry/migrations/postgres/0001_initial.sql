-- Initial registry schema, PostgreSQL dialect (same tables and constraints as SQLite's 0001).

CREATE TABLE model_artifact (
    model            TEXT NOT NULL,
    artifact_id      TEXT NOT NULL,
    manifest_uri     TEXT NOT NULL,
    manifest_sha256  TEXT NOT NULL CHECK (length(manifest_sha256) = 64),
    state            TEXT NOT NULL CHECK (state IN ('pending', 'ready', 'rejected')),
    feature_schema   TEXT NOT NULL,
    runtime          TEXT NOT NULL,
    metadata         JSONB NOT NULL DEFAULT '{}',
    state_actor      TEXT,
    state_reason     TEXT,
    created_at       TIMESTAMPTZ NOT NULL,
    updated_at       TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (model, artifact_id)
);

CREATE TABLE deployment_target (
    model        TEXT NOT NULL,
    environment  TEXT NOT NULL,
    cohort       TEXT NOT NULL CHECK (cohort IN ('stable', 'canary')),
    revision     BIGINT NOT NULL CHECK (revision > 0),
    artifact_id  TEXT NOT NULL,
    updated_at   TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (model, environment, cohort),
    FOREIGN KEY (model, artifact_id) REFERENCES model_artifact (model, artifact_id)
);

CREATE TABLE target_audit (
    id               BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    model            TEXT NOT NULL,
    environment      TEXT NOT NULL,
    cohort           TEXT NOT NULL CHECK (cohort IN ('stable', 'canary')),
    old_artifact_id  TEXT,
    new_artifact_id  TEXT NOT NULL,
    old_revision     BIGINT NOT NULL CHECK (old_revision >= 0),
    new_revision     BIGINT NOT NULL CHECK (new_revision > old_revision),
    actor            TEXT NOT NULL,
    reason           TEXT NOT NULL,
    approval         TEXT,
    at               TIMESTAMPTZ NOT NULL,
    FOREIGN KEY (model, new_artifact_id) REFERENCES model_artifact (model, artifact_id)
);
CREATE INDEX target_audit_by_cohort ON target_audit (model, environment, cohort, id);

CREATE TABLE rollout (
    id                     TEXT PRIMARY KEY,
    model                  TEXT NOT NULL,
    environment            TEXT NOT NULL,
    candidate_artifact_id  TEXT NOT NULL,
    baseline_artifact_id   TEXT,
    plan                   JSONB NOT NULL,
    phase                  TEXT NOT NULL,
    step                   INTEGER NOT NULL DEFAULT 0 CHECK (step >= 0),
    weights                JSONB NOT NULL DEFAULT '{}',
    verdicts               JSONB NOT NULL DEFAULT '[]',
    state                  JSONB NOT NULL DEFAULT '{}',
    reason                 TEXT,
    version                BIGINT NOT NULL CHECK (version > 0),
    created_at             TIMESTAMPTZ NOT NULL,
    updated_at             TIMESTAMPTZ NOT NULL,
    finished_at            TIMESTAMPTZ,
    FOREIGN KEY (model, candidate_artifact_id) REFERENCES model_artifact (model, artifact_id),
    FOREIGN KEY (model, baseline_artifact_id) REFERENCES model_artifact (model, artifact_id)
);
-- At most one unfinished rollout per model and environment.
CREATE UNIQUE INDEX rollout_one_active ON rollout (model, environment) WHERE finished_at IS NULL;
CREATE INDEX rollout_by_created ON rollout (model, environment, created_at);

CREATE TABLE replica_report (
    replica_id           TEXT PRIMARY KEY,
    model                TEXT NOT NULL,
    environment          TEXT NOT NULL,
    cohort               TEXT NOT NULL CHECK (cohort IN ('stable', 'canary')),
    state                TEXT NOT NULL,
    desired_revision     BIGINT,
    desired_artifact_id  TEXT,
    actual_revision      BIGINT,
    actual_artifact_id   TEXT,
    last_error           TEXT,
    heartbeat_at         TIMESTAMPTZ NOT NULL,
    capacity             JSONB NOT NULL DEFAULT '{}',
    timings              JSONB NOT NULL DEFAULT '{}'
);
CREATE INDEX replica_report_by_heartbeat ON replica_report (model, environment, heartbeat_at);
