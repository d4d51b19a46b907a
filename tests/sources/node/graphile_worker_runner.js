// A real graphile-worker for the source tests: `migrate`, or `worker` (runs until killed).
// Tasks write marker files (<job>-started-<attempt>, <job>-done-<attempt>) and sleep
// payload.hang[attempt - 1] seconds on the attempts the list covers (default: the first,
// an hour), so a test can kill or stop them mid-task.
// Environment: SOURCES_PG_CONNINFO, SOURCES_MARKERS; NODE_PATH finds graphile-worker.
"use strict";
const fs = require("fs");
const path = require("path");
const { run, runMigrations } = require("graphile-worker");

const connectionString = process.env.SOURCES_PG_CONNINFO;
const schema = "graphile_worker";
const mark = (name) =>
  fs.writeFileSync(path.join(process.env.SOURCES_MARKERS, name), String(process.pid));
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function work(payload, helpers) {
  const job = helpers.job;
  const attempt = job.attempts;
  mark(`${job.id}-started-${attempt}`);
  const hang = payload.hang ?? [3600];
  if (attempt - 1 < hang.length) {
    await sleep(hang[attempt - 1] * 1000);
  }
  mark(`${job.id}-done-${attempt}`);
}

async function main(mode) {
  if (mode === "migrate") {
    await runMigrations({ connectionString, schema });
    return;
  }
  const taskList = {};
  for (const name of ["idem.work", "effect.work", "pure.work", "skip.work"]) {
    taskList[name] = work;
  }
  const runner = await run({
    connectionString, schema, concurrency: 1, pollInterval: 100, taskList,
    noPreparedStatements: true,
  });
  mark(`worker-ready-${process.pid}`);
  await runner.promise;
}

main(process.argv[2]).then(
  () => process.exit(0),
  (error) => { console.error(error); process.exit(1); },
);
