{{- /* The chart's name, or nameOverride: the app.kubernetes.io/name label. */ -}}
{{- define "kubetrt.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /* Prefix of every object's name: fullnameOverride, else the release name with the chart's name. */ -}}
{{- define "kubetrt.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "kubetrt.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kubetrt.operatorName" -}}
{{- printf "%s-operator" (include "kubetrt.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kubetrt.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubetrt.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kubetrt.labels" -}}
{{ include "kubetrt.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubetrt
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kubetrt.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kubetrt.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- /* REPOSITORY:TAG of one image of .Values.image, called with (list $ IMAGE): an empty tag is the chart's appVersion. */ -}}
{{- define "kubetrt.image" -}}
{{- $root := index . 0 -}}
{{- $image := index . 1 -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}
