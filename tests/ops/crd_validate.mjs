// Validates custom resources against their CRD schemas, as compiled into the
// npm packages @kubernetes-models/keda and @kubernetes-models/prometheus-operator
// (pinned in tests/ops/package.json, installed by scripts/ops-check.sh).
//
//   node tests/ops/crd_validate.mjs <node_modules dir> <docs.json>
//
// docs.json is a JSON array of manifests. Exit 1 and one line per invalid
// object (kind/name: the schema's complaint); exit 0 when all are valid.
import { pathToFileURL } from "node:url";
import { readFileSync } from "node:fs";
import { join } from "node:path";

const MODELS = {
  "keda.sh/v1alpha1": {
    ScaledObject: "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject.js",
    TriggerAuthentication: "@kubernetes-models/keda/keda.sh/v1alpha1/TriggerAuthentication.js",
  },
  "monitoring.coreos.com/v1": {
    PodMonitor: "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor.js",
    ServiceMonitor: "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor.js",
    PrometheusRule: "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule.js",
  },
};

const [modulesDir, docsFile] = process.argv.slice(2);
const docs = JSON.parse(readFileSync(docsFile, "utf8"));
let failures = 0;
for (const doc of docs) {
  const id = `${doc.kind}/${doc.metadata?.name}`;
  const file = MODELS[doc.apiVersion]?.[doc.kind];
  if (!file) {
    console.log(`${id}: no schema for ${doc.apiVersion} ${doc.kind}`);
    failures++;
    continue;
  }
  const mod = await import(pathToFileURL(join(modulesDir, file)).href);
  try {
    new mod[doc.kind](doc).validate();
  } catch (e) {
    console.log(`${id}: ${e.message}`);
    failures++;
  }
}
process.exit(failures ? 1 : 0);
