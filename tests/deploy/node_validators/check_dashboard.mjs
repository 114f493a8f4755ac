// Type-checks a Grafana dashboard JSON against the Dashboard type of @grafana/schema.
//
//   node tests/deploy/node_validators/check_dashboard.mjs deploy/grafana/dashboards/vcap.json
//
// The JSON becomes a TypeScript object literal checked with `satisfies`, so wrong types, missing
// required fields and unknown keys fail. Exit status: tsc's.
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const dashboardPath = process.argv[2];
const json = fs.readFileSync(dashboardPath, 'utf8').trim();
const work = fs.mkdtempSync(path.join(os.tmpdir(), 'vcap-dashboard-'));
fs.symlinkSync(path.join(here, 'node_modules'), path.join(work, 'node_modules'));
const source = path.join(work, 'dashboard.ts');
fs.writeFileSync(source, `import type { Dashboard } from '@grafana/schema';

// JSON holds an enum's value, not the enum: accept the values of string enums. Queries,
// annotation queries and variables carry datasource-specific keys (a Prometheus annotation's
// titleFormat, a query variable's definition) that Grafana writes itself: their other keys are
// open. Everything else may use only the keys the schema knows.
type Json<T> =
  T extends string ? \`\${T}\` :
  T extends number | boolean | null | undefined ? T :
  T extends Array<infer U> ? Array<Json<U>> :
  T extends { refId: string } | { iconColor: string; enable: boolean } | { name: string; type: string }
    ? { [K in keyof T]: Json<T[K]> } & Record<string, unknown> :
  T extends object ? { [K in keyof T]: Json<T[K]> } : T;

export const dashboard = ${json} satisfies Json<Dashboard>;
`);
const tsc = path.join(here, 'node_modules', '.bin', 'tsc');
try {
  execFileSync(tsc, ['--noEmit', '--strict', '--skipLibCheck', '--module', 'esnext',
    '--moduleResolution', 'bundler', '--target', 'es2022', source], { stdio: 'inherit', cwd: work });
} catch (error) {
  process.exitCode = error.status ?? 1;
} finally {
  fs.rmSync(work, { recursive: true, force: true });
}
