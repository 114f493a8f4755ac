// Validates ServiceMonitor objects against the Prometheus Operator's CRD schema.
//
//   python -c '...' | node tests/deploy/node_validators/check_servicemonitor.mjs
//
// Reads a JSON array of ServiceMonitor objects on stdin; exits non-zero on the first invalid one.
import fs from 'node:fs';
import { ServiceMonitor } from '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor';

for (const object of JSON.parse(fs.readFileSync(0, 'utf8'))) {
  new ServiceMonitor(object).validate();
  console.log(`valid: ServiceMonitor/${object.metadata.name}`);
}
