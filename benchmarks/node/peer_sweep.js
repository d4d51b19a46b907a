// The stalled-job sweep a Node job system runs itself, timed on its own schema, through
// the installed package's own code (never a copy of its SQL):
//   graphile-worker: resetLockedAt(), which every worker pool runs periodically (unlocks
//                    jobs and queues locked for more than 4 hours);
//   pg-boss:         the maintenance expiry (failJobsByTimeout under its advisory lock),
//                    which retries or fails `active` jobs past their `expire_in`.
// Usage: node peer_sweep.js graphile-worker|pg-boss SCHEMA RUNS
// Prints a JSON array of milliseconds, one per run. Environment: PEER_PG_CONNINFO;
// NODE_PATH finds graphile-worker, pg-boss and pg.
"use strict";
const { Client } = require("pg");

function sweepOf(system, schema) {
  if (system === "pg-boss") {
    const plans = require("pg-boss/src/plans");
    const text = plans.locked(schema, plans.failJobsByTimeout(schema));
    return (client) => client.query(text);
  }
  if (system === "graphile-worker") {
    const { resetLockedAt } = require("graphile-worker/dist/sql/resetLockedAt");
    const options = {
      escapedWorkerSchema: `"${schema}"`,
      workerSchema: schema,
      resolvedPreset: { worker: { preparedStatements: true, useNodeTime: false } },
    };
    return (client) => resetLockedAt(options, { withRetries: (fn) => fn(client) });
  }
  throw new Error(`no sweep for ${system}`);
}

async function main(system, schema, runs) {
  const client = new Client({ connectionString: process.env.PEER_PG_CONNINFO });
  await client.connect();
  const sweep = sweepOf(system, schema);
  const samples = [];
  try {
    for (let i = 0; i < runs; i += 1) {
      const started = process.hrtime.bigint();
      await sweep(client);
      samples.push(Number(process.hrtime.bigint() - started) / 1e6);
    }
  } finally {
    await client.end();
  }
  process.stdout.write(JSON.stringify(samples));
}

main(process.argv[2], process.argv[3], Number(process.argv[4] || "1")).catch((error) => {
  console.error(String(error && error.stack || error));
  process.exit(1);
});
