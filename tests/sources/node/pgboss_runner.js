// A real pg-boss for the source tests: `migrate`, `worker QUEUE...` (runs until killed), or
// `send` (reads [{name, data, options}] as JSON on stdin, creates each queue with pg-boss's
// own createQueue, sends each job with its own send, prints the ids as a JSON list).
// Handlers write marker files (<job>-started-<attempt>, <job>-done-<attempt>, the attempt
// being retryCount) and sleep data.hang[attempt] seconds on the attempts the list covers
// (default: the first, an hour).
// Maintenance (supervise) is off, so pg-boss's own expiry never races the tests, unless
// SOURCES_PGBOSS_MAINTENANCE_SECONDS sets how often it runs (its expiry of active jobs
// included): the tests of pg-boss's own expiry turn it on.
// Environment: SOURCES_PG_CONNINFO, SOURCES_MARKERS; NODE_PATH finds pg-boss.
"use strict";
const fs = require("fs");
const path = require("path");
const PgBoss = require("pg-boss");

const connectionString = process.env.SOURCES_PG_CONNINFO;
const mark = (name) =>
  fs.writeFileSync(path.join(process.env.SOURCES_MARKERS, name), String(process.pid));
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function work([job]) {
  const attempt = job.retryCount;
  mark(`${job.id}-started-${attempt}`);
  const hang = job.data.hang ?? [3600];
  if (attempt < hang.length) {
    await sleep(hang[attempt] * 1000);
  }
  mark(`${job.id}-done-${attempt}`);
}

async function send(boss) {
  const jobs = JSON.parse(fs.readFileSync(0, "utf8"));
  const queues = new Set(jobs.map((job) => job.name));
  for (const name of queues) {
    if (!(await boss.getQueue(name))) {
      await boss.createQueue(name);
    }
  }
  const ids = [];
  for (const job of jobs) {
    ids.push(await boss.send(job.name, job.data, job.options));
  }
  process.stdout.write(JSON.stringify(ids));
}

async function main(mode, queues) {
  const maintenance = Number(process.env.SOURCES_PGBOSS_MAINTENANCE_SECONDS || 0);
  const boss = new PgBoss({ connectionString, schema: "pgboss", schedule: false,
                            supervise: maintenance > 0 && mode === "worker",
                            ...(maintenance > 0 ? { maintenanceIntervalSeconds: maintenance }
                                                : {}) });
  boss.on("error", (error) => console.error(error));
  await boss.start();
  if (mode === "migrate") {
    await boss.stop({ graceful: false, wait: true });
    return false;
  }
  if (mode === "send") {
    await send(boss);
    await boss.stop({ graceful: false, wait: true });
    return false;
  }
  for (const queue of queues) {
    await boss.work(queue, { pollingIntervalSeconds: 0.5, batchSize: 1,
                             includeMetadata: true }, work);
  }
  mark(`worker-ready-${process.pid}`);
  return true;
}

main(process.argv[2], process.argv.slice(3)).then(
  (keepRunning) => { if (!keepRunning) process.exit(0); },
  (error) => { console.error(error); process.exit(1); },
);
