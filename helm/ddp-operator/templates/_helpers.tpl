{{/* Names, labels and the few derived settings every template shares. */}}

{{- define "ddp-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release name, plus the chart name unless the release name already contains it. */}}
{{- define "ddp-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "ddp-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ddp-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ddp-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ddp-operator.labels" -}}
helm.sh/chart: {{ include "ddp-operator.chart" . }}
{{ include "ddp-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: ddpjob
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "ddp-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ddp-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ddp-operator.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* "true" when kopf peering is on: explicitly, or automatically with more than one replica. */}}
{{- define "ddp-operator.peering" -}}
{{- $mode := .Values.operator.peering.mode }}
{{- if or (eq $mode "on") (and (eq $mode "auto") (gt (int .Values.replicaCount) 1)) }}true{{ end }}
{{- end }}

{{/*
The namespaces that get a Role in namespace scope. Fails early, with the fix, on a combination that
would install an operator unable to see anything.
*/}}
{{- define "ddp-operator.validate" -}}
{{- if and (eq .Values.rbac.scope "namespace") (not .Values.watch.namespaces) }}
{{- fail "rbac.scope=namespace needs watch.namespaces (e.g. --set 'watch.namespaces={team-a}'); leave rbac.scope=cluster to watch every namespace" }}
{{- end }}
{{- if eq .Values.image.tag "latest" }}
{{- fail "image.tag=latest is refused: pin a version (leave it empty for the chart's appVersion)" }}
{{- end }}
{{- if and (gt (int .Values.replicaCount) 1) (eq .Values.operator.peering.mode "off") }}
{{- fail "replicaCount > 1 needs peering (operator.peering.mode auto or on): two active operators would both act on every DDPJob" }}
{{- end }}
{{- end }}

{{/*
Rules the operator needs in every namespace it watches; the cluster scope adds Nodes and CRDs.
Least privilege: no secrets, no configmaps, no pods/exec; pods are never updated, only patched.
*/}}
{{- define "ddp-operator.namespacedRules" -}}
- apiGroups: [ddp.dev]
  resources: [ddpjobs]
  verbs: [get, list, watch, patch]
- apiGroups: [ddp.dev]
  resources: [ddpjobs/status]
  verbs: [get, patch]
# Owner references with blockOwnerDeletion need this where OwnerReferencesPermissionEnforcement is on.
- apiGroups: [ddp.dev]
  resources: [ddpjobs/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- if include "ddp-operator.peering" . }}
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end }}
