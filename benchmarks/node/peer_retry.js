// pg-boss's own bulk retry, timed, for benchmarks/foreign_bulk.py: the ids of the queue's
// failed jobs read in one SELECT (pg-boss 10 lists no failed jobs itself: a user reads its
// job table), then `boss.retry(queue, ids)`, its retry of many ids in one call (one UPDATE
// to state `retry`, through the installed package's own code). pg-boss is started with
// its maintenance and schedule off, before the timing starts.
// Usage: node peer_retry.js SCHEMA QUEUE
// Prints {"ms": ..., "requested": ..., "affected": ...}. Environment: PEER_PG_CONNINFO;
// NODE_PATH finds pg-boss.
"use strict";
const PgBoss = require("pg-boss");

async function main(schema, queue) {
  const boss = new PgBoss({ connectionString: process.env.PEER_PG_CONNINFO, schema,
                            supervise: false, schedule: false });
  boss.on("error", (error) => console.error(error));
  await boss.start();
  try {
    const started = process.hrtime.bigint();
    const failed = await boss.getDb().executeSql(
      `SELECT id FROM ${schema}.job WHERE name = $1 AND state = 'failed'`, [queue]);
    const result = await boss.retry(queue, failed.rows.map((row) => row.id));
    const ms = Number(process.hrtime.bigint() - started) / 1e6;
    process.stdout.write(JSON.stringify({ ms, requested: result.requested,
                                          affected: result.affected }));
  } finally {
    await boss.stop({ graceful: false, wait: true });
  }
}

main(process.argv[2], process.argv[3]).catch((error) => {
  console.error(String(error && error.stack || error));
  process.exit(1);
});
