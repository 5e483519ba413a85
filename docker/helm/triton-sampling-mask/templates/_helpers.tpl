{{/* The chart's name, overridable. */}}
{{- define "tsm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Resource names: <release>-<chart>, or the release alone when it already contains the chart's name. */}}
{{- define "tsm.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The labels that select this release's pods (never change them after an install). */}}
{{- define "tsm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tsm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "tsm.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tsm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The image reference: repository@digest when a digest is given, else repository:tag (tag defaults to appVersion). */}}
{{- define "tsm.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The Secret that holds the admin key: the user's, or the one this chart creates. */}}
{{- define "tsm.adminSecretName" -}}
{{- default (printf "%s-admin" (include "tsm.fullname" .)) .Values.adminKey.existingSecret -}}
{{- end -}}

{{- define "tsm.serviceAccountName" -}}
{{- default (include "tsm.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* The router's name: <fullname>-router. */}}
{{- define "tsm.routerName" -}}
{{- printf "%s-router" (include "tsm.fullname" . | trunc 56 | trimSuffix "-") -}}
{{- end -}}

{{/* The router pods' selector labels. Not the replicas' (app.kubernetes.io/name differs): the replicas'
Deployment, Service and the router's own discovery select the replicas only. */}}
{{- define "tsm.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "tsm.name" . | trunc 56 | trimSuffix "-" }}-router
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tsm.routerLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tsm.routerSelectorLabels" . }}
app.kubernetes.io/component: router
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The router image: repository@digest when a digest is given, else repository:tag (tag defaults to appVersion). */}}
{{- define "tsm.routerImage" -}}
{{- $image := .Values.router.image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}
